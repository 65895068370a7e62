"""--spec-type as llama.cpp reads it (common_speculative_types_from_names): which names draft here."""

from __future__ import annotations

import re

import pytest

from orchestrator.engine.speculative import SPEC_TYPES_NOT_RUN, drafting_wanted


def test_a_draft_model_drafts_without_spec_type_and_with_draft_simple():
    assert drafting_wanted(None, True) and drafting_wanted("draft-simple", True)
    assert not drafting_wanted(None, False)


@pytest.mark.parametrize("types", ["none", "none,draft-simple", "none,no-such-type"])
def test_none_ends_the_list_and_the_draft_is_not_used(types):
    assert not drafting_wanted(types, True) and not drafting_wanted(types, False)


@pytest.mark.parametrize(("types", "message"), [
    ("draft-simpel", "unknown speculative type: draft-simpel"),
    ("draft-simple,ngram-mod", "speculative type ngram-mod is not supported here"),
    ("draft-simple", "draft-simple needs a draft model (-md)"),
])
def test_what_cannot_run_is_refused_with_its_reason(types, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        drafting_wanted(types, types != "draft-simple")


def test_every_name_llama_cpp_knows_is_known_here():
    """The names of the pinned llama.cpp's table, read from its source: none is 'unknown' here."""
    from tools import reference  # noqa: PLC0415

    try:
        source = (reference.llama_source_dir() / "common" / "speculative.cpp").read_text()
    except (reference.ReferenceMissing, OSError) as exc:
        pytest.fail(str(exc), pytrace=False)
    table = source[source.index("common_speculative_type_from_name_map"):]
    names = re.findall(r'\{"([a-z0-9-]+)",\s*COMMON_SPECULATIVE_TYPE_', table[:table.index("};")])
    assert "draft-simple" in names and "none" in names
    assert sorted(set(names) - {"none", "draft-simple"}) == sorted(SPEC_TYPES_NOT_RUN)
