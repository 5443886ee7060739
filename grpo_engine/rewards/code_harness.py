"""The program CodeTests runs in the sandbox for a completion's call tests (its text is the program; it
is never imported by the trainer, and it imports nothing of the package).

Stdin: a token line, a JSON line of jobs (``{"fn", "args", "kwargs"}``: a function name and Python literal
source of its arguments; or, opt-in, ``{"assert": source}``), then the code as a JSON string. No expected
value is among them. It compiles and runs the code in a namespace of its own (``__name__`` is
``"solution"``), then each job, in order, with arguments evaluated afresh for each call. Each result is a
line ``<token> <index> returned <json>`` (the value as plain JSON data: exact int, float, bool, None, str,
list, tuple as a list, dict with str keys, copied before it is written), ``<token> <index> unserialisable``
or ``<token> <index> exception`` (an assert: ``passed`` / ``assertion`` / ``exception``), written on a
duplicate of the original stdout; the code's own prints go to /dev/null. A code that does not compile or
raises: ``<token> code syntax`` / ``<token> code error``. The host trusts none of it but the values.
"""

import ast
import json
import os
import sys


def plain(value, depth=0):
    """A copy of ``value`` holding only exact built-in JSON types, else TypeError / ValueError."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is float or kind is str:
        return value
    if depth > 100:
        raise ValueError("nested too deep")
    if kind is list or kind is tuple:
        return [plain(item, depth + 1) for item in value]
    if kind is dict:
        copy = {}
        for key, item in value.items():
            if type(key) is not str:
                raise TypeError("a dict key that is not a str")
            copy[key] = plain(item, depth + 1)
        return copy
    raise TypeError("not plain JSON data")


def run(job, space):
    """One job's report fields."""
    if "assert" in job:
        try:
            exec(job["assert"], space)
            return ("passed",)
        except AssertionError:
            return ("assertion",)
        except BaseException:
            return ("exception",)
    try:
        value = space[job["fn"]](*ast.literal_eval(job["args"]), **ast.literal_eval(job["kwargs"]))
    except BaseException:
        return ("exception",)
    try:
        return ("returned", json.dumps(plain(value)))
    except BaseException:
        return ("unserialisable",)


def main():
    token, jobs = sys.stdin.readline().strip(), json.loads(sys.stdin.readline())
    code = json.loads(sys.stdin.read())
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    except OSError:
        os.dup2(2, 1)

    def report(*fields):
        out.write("\n" + " ".join((token, *fields)) + "\n")  # a line of its own after any stray bytes
        out.flush()

    try:
        compiled = compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return report("code", "syntax")
    space = {"__name__": "solution"}
    try:
        exec(compiled, space)
    except BaseException:
        return report("code", "error")
    for index, job in enumerate(jobs):
        report(str(index), *run(job, space))


if __name__ == "__main__":
    main()
