"""How a SOURCE, a --base-model or a config's `_name_or_path` is told to be a Hub repo id."""

from __future__ import annotations

import pytest

from prequant.source.spec import is_repo_id


@pytest.mark.parametrize("text", ["meta-llama/Llama-3.1-8B", "org/name", "a_b/c.d-e", "Org9/x"])
def test_a_repo_id_is_org_slash_name(text):
    assert is_repo_id(text)


@pytest.mark.parametrize("text", ["gpt2", "not a repo", "./x/y", "/x/y", "~/x", "a/b/c", "org/name@main", "org/",
                                  "org/na--me", "org/name.", "-org/name", "org/" + "x" * 97])
def test_anything_else_is_not(text):
    assert not is_repo_id(text)
