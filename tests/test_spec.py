"""Checking requests against model specs, and output-size estimates."""

from __future__ import annotations

import numpy as np
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


def test_a_name_given_two_values_is_refused_only_where_check_dims_asks():
    """Runtimes do not hold same-named dimensions equal: by default neither do we, and an output
    sized by that name gets the fallback; with check_dims the mismatch is bad_shape naming the key."""
    mismatched = [TensorMeta("a", "float32", (4, 3)), TensorMeta("b", "int64", (5, 1))]
    symbols = bind_inputs(SPEC, mismatched)
    assert symbols == {}
    assert estimate_output_bytes(SPEC, symbols, fallback=1000) == 2 * (1000 + 64)
    checked = ModelSpec.from_dict({**SPEC.to_dict(), "check_dims": ["batch"]})
    assert checked.check_dims == ("batch",)
    assert bind_inputs(checked, [TensorMeta("a", "float32", (4, 3)), TensorMeta("b", "int64", (4, 1))]) == {"batch": 4}
    with pytest.raises(ShmserveError) as info:
        bind_inputs(checked, mismatched)
    assert info.value.code is ErrorCode.BAD_SHAPE and "check_dims" in info.value.message


@pytest.mark.parametrize("placeholder", ["?", "None", "", -1, None])
def test_exporters_placeholders_are_unnamed_and_never_bind(placeholder):
    spec = ModelSpec("p", "onnxruntime",
                     (TensorSpec("a", "float32", (placeholder, 3)), TensorSpec("b", "float32", (placeholder,))),
                     (TensorSpec("y", "float32", (placeholder, 3)),))
    assert spec.inputs[0].shape == (None, 3)
    symbols = bind_inputs(spec, [TensorMeta("a", "float32", (192, 3)), TensorMeta("b", "float32", (192,))])
    assert symbols == {} and estimate_output_bytes(spec, symbols, fallback=500) == 500 + 64


def test_check_dims_must_name_an_input_dimension():
    from shmserve.spec import check_dims_used

    check_dims_used(ModelSpec.from_dict({**SPEC.to_dict(), "check_dims": ["batch"]}))
    with pytest.raises(ValueError, match="'btach', which no input"):
        check_dims_used(ModelSpec.from_dict({**SPEC.to_dict(), "check_dims": ["btach"]}))


def test_new_dtypes_in_specs_and_a_bytes_output_reserves_the_fallback():
    import ml_dtypes

    for given, name in [("bfloat16", "bfloat16"), (ml_dtypes.bfloat16, "bfloat16"), ("bytes", "bytes"),
                        ("f4", "float32")]:
        assert TensorSpec.from_dict({"name": "x", "dtype": given, "shape": [1]}).dtype == name
    for bad in ("S", object, "object", np.bytes_, "complex64"):  # numpy's own names for bytes are not bytes
        with pytest.raises(ValueError, match="not supported"):
            TensorSpec.from_dict({"name": "x", "dtype": bad, "shape": [1]})
    spec = ModelSpec("m", "python", (TensorSpec("x", "bytes", ("n",)),),
                     (TensorSpec("y", "bytes", ("n",)), TensorSpec("z", "bfloat16", ("n",))))
    symbols = bind_inputs(spec, [TensorMeta("x", "bytes", (5,), byte_size=40)])
    assert symbols == {"n": 5}
    assert estimate_output_bytes(spec, symbols, 1000) == 1000 + 64 + 10 + 64
