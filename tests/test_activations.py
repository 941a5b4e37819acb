"""The one activation table (fastattn/activations.py) and its C++ mirror agree, and every user of
activation names reads the table."""

import importlib
import re
from pathlib import Path

import pytest

from fastattn import activations as act
from fastattn import reference
from fastattn.nn.transformer import activation_name

ffn_ops = importlib.import_module("fastattn.ops.ffn")
HEADER = Path(__file__).resolve().parents[1] / "csrc" / "include" / "fastattn" / "activation.h"


def _header():
    text = HEADER.read_text()
    enum = dict((name, int(code)) for name, code in re.findall(r"\b(k\w+)\s*=\s*(\d+)", text.split("enum Act")[1].split("}")[0]))
    parsed = {
        name: (enum[code], gated == "true")
        for name, code, gated in re.findall(r'name == "(\w+)"\) return \{(k\w+), (true|false)\}', text)
    }
    return enum, parsed


def test_cpp_table_matches_python_table():
    enum, parsed = _header()
    assert enum == {"kGelu": act.GELU, "kGeluTanh": act.GELU_TANH, "kRelu": act.RELU, "kSilu": act.SILU}
    assert parsed == {a.name: (a.code, a.gated) for a in act.TABLE.values()}


def test_every_user_reads_the_table():
    assert reference.ACTIVATIONS == act.ACTIVATIONS
    assert reference.GATED_ACTIVATIONS == act.GATED
    assert ffn_ops.ACTIVATIONS == act.ACTIVATIONS and ffn_ops.GATED == act.GATED
    for name in act.ACTIVATIONS:
        assert activation_name(name) == name


def test_triton_ids_are_the_table_codes():
    pytest.importorskip("triton")
    from fastattn.kernels import ffn as kernels

    assert (kernels._GELU.value, kernels._GELU_TANH.value, kernels._RELU.value, kernels._SILU.value) == (
        act.GELU, act.GELU_TANH, act.RELU, act.SILU,
    )


@pytest.mark.parametrize("bad", ["tanh", "", None, "GELU"])
def test_unknown_names_are_a_clear_error(bad):
    with pytest.raises(ValueError, match="unknown activation"):
        act.lookup(bad)
