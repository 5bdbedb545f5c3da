"""Token-id lists are checked in bulk (validation.py); an offender is still refused by its own path."""
from __future__ import annotations

import pytest

from prefixserve.entrypoints.server.validation import MAX_DEPTH, BodyLimits, check_parsed_body
from prefixserve.errors import InvalidRequestError

LIMITS = BodyLimits(max_messages=8, trust_request_chat_template=False)


@pytest.mark.parametrize("bad", [2**63, -2**63 - 1, 10**29])
@pytest.mark.parametrize("at", [0, 417, 899])
def test_an_id_beyond_64_bits_is_named_by_its_index(bad, at):
    ids = list(range(900))
    ids[at] = bad
    with pytest.raises(InvalidRequestError) as err:
        check_parsed_body({"prompt": [list(range(5)), ids]}, LIMITS)
    assert err.value.param == f"prompt[1][{at}]"


def test_the_widest_ids_pass():
    check_parsed_body({"prompt": [2**63 - 1, -2**63, 0, 7]}, LIMITS)


def test_ids_nested_past_the_depth_bound_are_refused():
    # the innermost list sits at depth MAX_DEPTH (the body is 0, its prompt 1): its ids one past
    deep: list = [1, 2, 3]
    for _ in range(MAX_DEPTH - 1):
        deep = [deep]
    with pytest.raises(InvalidRequestError, match="nests deeper"):
        check_parsed_body({"prompt": deep}, LIMITS)
    shallow: list = [1, 2, 3]
    for _ in range(MAX_DEPTH - 2):
        shallow = [shallow]
    check_parsed_body({"prompt": shallow}, LIMITS)


def test_a_bool_or_float_among_ids_is_still_walked():
    with pytest.raises(InvalidRequestError) as err:
        check_parsed_body({"prompt": [1, 2, float("nan"), 4]}, LIMITS)
    assert err.value.param == "prompt[2]"
