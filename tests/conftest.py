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


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny random model and its tokenizer saved as a transformers folder (loaded by path)."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tok = char_tokenizer()
    tiny_llama(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
