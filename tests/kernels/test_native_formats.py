"""The C++ weight-format table derives from the registry (runtime/weight_formats.py): native_build
generates formats.h from the records, the library reports the table it was built with and is
checked against the registry when loaded, and a kernel rejects an id outside its table by name."""

from __future__ import annotations

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runtime import cpu_kernels, native_build, weight_formats
from jaxserve.runtime.weight_formats import DOT_MATMUL, FORMATS, NATIVE_KERNELS, QUANT_MATMUL

WHY = cpu_kernels.available()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"native CPU kernel unavailable: {WHY}")


def header_enums(header: str) -> dict[str, dict[str, int]]:
    """{kernel: {enumerator: id}} as formats.h declares them."""
    enums = {}
    for kernel, body in re.findall(r"namespace (\w+) \{[^\n]*\nenum Format : int32_t \{ ([^}]*) \};", header):
        enums[kernel] = {name: int(v) for name, v in (e.split(" = ") for e in body.split(", "))}
    return enums


def test_header_ids_are_the_registry_ids():
    header = native_build.formats_header()
    want = {k: {native_build.cc_name(f): f.id for f in FORMATS if f.kernel == k} for k in NATIVE_KERNELS}
    assert header_enums(header) == want
    assert want[QUANT_MATMUL]["kQ8_0"] == weight_formats.format_of(weight_formats.quantize(
        np.ones((32, 64), np.float32), "q8_0")).id
    for kernel in NATIVE_KERNELS:
        assert f"constexpr int32_t kFormats = {len(want[kernel])};" in header
    assert f"constexpr int kPanel = {weight_formats.PANEL};" in header
    assert f'kFormatTable[] = "{native_build.format_table()}"' in header


@pytest.mark.parametrize("bad", [{"q8_0": 4}, {"w8a8": 0}, {"bfloat16": -1}])
def test_a_wrong_id_is_rejected_by_the_generator(bad):
    """Ids must run 0, 1, ... per kernel in the records' order: a gap, a twin, a negative one fails
    the build naming the kernel and the ids, before any C++ is compiled."""
    formats = [dataclasses.replace(f, id=bad.get(f.name, f.id)) for f in FORMATS]
    kernel = next(f.kernel for f in FORMATS if f.name in bad)
    with pytest.raises(ValueError, match=rf"weight formats of {kernel}: ids .* are not 0, 1, \.\.\."):
        native_build.formats_header(formats)


def test_the_header_is_part_of_the_library_key():
    header = native_build.formats_header()
    assert native_build.library_path("g++", header) != native_build.library_path("g++", header + "// changed\n")


@needs_kernel
def test_the_library_reports_the_registry_table():
    lib = cpu_kernels._state["lib"]
    cpu_kernels.check_formats(lib)
    assert lib.JaxserveFormats().decode() == native_build.format_table()

    def stale():  # a library built from another table
        return b"quant_matmul:int8=1"

    with pytest.raises(RuntimeError, match="the kernel library's weight formats .* are not"):
        cpu_kernels.check_formats(types.SimpleNamespace(JaxserveFormats=stale))


@needs_kernel
@pytest.mark.parametrize("kernel,name,bad", [(QUANT_MATMUL, "int8", 7), (QUANT_MATMUL, "q8_0", -1),
                                             (DOT_MATMUL, "w8a8", 5)])
def test_a_kernel_rejects_an_unknown_id(kernel, name, bad):
    fmt = weight_formats._BY_NAME[name]
    w = jax.device_put(fmt.quantize(np.ones((64, 64), np.float32)))
    x = jnp.ones((2, 64), jnp.float32)
    attrs = {"format": np.int32(bad), "eps": np.float32(0)} | ({"isa": np.int32(0)} if kernel == DOT_MATMUL else {})
    call = jax.ffi.ffi_call(f"jaxserve_{kernel}", jax.ShapeDtypeStruct((2, 64), jnp.float32))
    no_fusion = (jnp.zeros((0,), jnp.float32),) * 2  # norm, residual (format_matmul.h's RowFusion)
    with pytest.raises(Exception, match=rf"unknown weight format id {bad} \(formats.h, .* has 0\.\.\d\)"):
        np.asarray(jax.jit(lambda x, w: call(x, *fmt.operands(w), jnp.full((1,), 2, jnp.int32), *no_fusion,
                                             **attrs))(x, w))
