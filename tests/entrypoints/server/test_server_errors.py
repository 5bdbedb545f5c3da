"""The one mapping from the error hierarchy to HTTP: every class has its status, a client
mistake is never a 5xx and always names its field, and no 500 shows internals."""
from __future__ import annotations

import inspect

import pytest

from prefixserve import errors
from prefixserve.entrypoints.server.errors import api_error

CLASSES = [c for _, c in inspect.getmembers(errors, inspect.isclass)
           if issubclass(c, errors.PrefixServeError)]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_has_a_status_by_its_kind(cls) -> None:
    err = api_error(cls("boom", param="field_x"))
    if issubclass(cls, (errors.InvalidRequestError, errors.NotFoundError, errors.ConflictError)):
        assert 400 <= err.status < 500 and err.param == "field_x"
    elif issubclass(cls, errors.QueueFullError):
        assert err.status == 429 and err.headers["Retry-After"]
    elif issubclass(cls, errors.RequestAbortedError):
        assert err.status == 499
    elif issubclass(cls, (errors.PinLimitError, errors.CachedContentLimitError)):
        assert err.status == 409  # a cap on what the cache holds, not a server fault
    else:
        assert err.status >= 500 and err.param is None
    assert err.message == "boom" and err.code == cls("x").code


def test_the_tree_is_rooted_and_client_mistakes_are_value_errors() -> None:
    assert all(issubclass(c, errors.PrefixServeError) for c in CLASSES)
    for cls in CLASSES:
        if issubclass(cls, errors.InvalidRequestError):
            assert issubclass(cls, ValueError)


def test_an_unknown_exception_is_a_500_that_shows_no_internals() -> None:
    err = api_error(KeyError("secret_internal_name"))
    assert err.status == 500
    assert "secret_internal_name" not in err.message and "KeyError" not in err.message


def test_renames_put_the_endpoints_spelling_in_param_and_message() -> None:
    from prefixserve import SamplingParams
    with pytest.raises(errors.InvalidRequestError) as info:
        SamplingParams(logprobs=99)
    err = api_error(info.value, renames={"logprobs": "top_logprobs"})
    assert err.status == 400 and err.param == "top_logprobs"
    assert err.message.startswith("top_logprobs must be")


def test_a_field_blamed_by_the_caller_fills_in_for_an_error_that_names_none() -> None:
    err = api_error(errors.PromptTooLongError("too long"), param="messages")
    assert err.status == 400 and err.param == "messages" and err.code == "context_length_exceeded"
