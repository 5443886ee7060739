import pytest
import torch

from tests.tiny import char_tokenizer, tiny_llama

torch.set_num_threads(2)


@pytest.fixture
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    return tiny_llama(len(tokenizer))
