"""Checking requests against model specs, and output-size estimates."""

from __future__ import annotations

import pytest

from shmserve.errors import ErrorCode, ShmserveError
from shmserve.protocol import TensorMeta
from shmserve.spec import ModelSpec, TensorSpec, bind_inputs, estimate_output_bytes, merge_overrides

SPEC = ModelSpec("m", "python",
                 (TensorSpec("a", "float32", ("batch", 3)), TensorSpec("b", "int64", ("batch", None))),
                 (TensorSpec("y", "float32", ("batch", 10)), TensorSpec("z", "uint8", (None,))))


def test_bind_symbols_and_estimate():
    symbols = bind_inputs(SPEC, [TensorMeta("a", "float32", (4, 3)), TensorMeta("b", "int64", (4, 7))])
    assert symbols == {"batch": 4}
    assert estimate_output_bytes(SPEC, symbols, fallback=1000) == 4 * 10 * 4 + 64 + 1000 + 64


@pytest.mark.parametrize("inputs,code", [
    ([TensorMeta("a", "float32", (4, 3))], ErrorCode.BAD_INPUT),
    ([TensorMeta("a", "float32", (4, 3)), TensorMeta("b", "int64", (4, 1)), TensorMeta("c", "int8", ())],
     ErrorCode.BAD_INPUT),
    ([TensorMeta("a", "float64", (4, 3)), TensorMeta("b", "int64", (4, 1))], ErrorCode.BAD_DTYPE),
    ([TensorMeta("a", "float32", (4, 3, 1)), TensorMeta("b", "int64", (4, 1))], ErrorCode.BAD_SHAPE),
    ([TensorMeta("a", "float32", (4, 2)), TensorMeta("b", "int64", (4, 1))], ErrorCode.BAD_SHAPE),
    ([TensorMeta("a", "float32", (4, 3)), TensorMeta("b", "int64", (5, 1))], ErrorCode.BAD_SHAPE),
])
def test_mismatches(inputs, code):
    with pytest.raises(ShmserveError) as info:
        bind_inputs(SPEC, inputs)
    assert info.value.code is code


def test_overrides_replace_by_name_and_reject_typos():
    reported = (TensorSpec("x", "float32", (None, 3)),)
    merged = merge_overrides(reported, (TensorSpec("x", "float32", ("batch", 3)),))
    assert merged[0].shape == ("batch", 3)
    with pytest.raises(ValueError, match="does not have"):
        merge_overrides(reported, (TensorSpec("typo", "float32", (1,)),))
    assert merge_overrides((), (TensorSpec("x", "uint8", (1,)),))[0].name == "x"


def test_roundtrip_dict():
    assert ModelSpec.from_dict(SPEC.to_dict()) == SPEC
