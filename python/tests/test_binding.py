"""The cffi binding against the installed header: every struct's fields, the status codes and the
version string."""

import os
import re

import pytest

import clmha
from clmha._native import ffi


def _header(name):
    with open(os.path.join(clmha.get_include(), name), encoding="utf-8") as f:
        return f.read()


def _strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _decl_names(decl):
    """The field names one declaration ("size_t a, b[4], *c" or a function pointer) declares."""
    decl = " ".join(decl.split())
    if not decl:
        return []
    fp = re.search(r"\(\s*\*\s*(\w+)\s*\)\s*\(", decl)
    if fp:
        return [fp.group(1)]
    parts = decl.split(",")
    names = [re.findall(r"(\w+)\s*(?:\[[^\]]*\]\s*)*$", parts[0].strip())[0]]
    for p in parts[1:]:
        names.append(re.match(r"[\s*]*(\w+)", p).group(1))
    return names


def _structs():
    text = _strip_comments(_header("clmha.h"))
    text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
    out = {}
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{", text):
        name = m.group(1)
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        body = text[m.end():i - 1]
        tail = re.match(r"\s*(\w+)\s*;", text[i:])
        assert tail and tail.group(1) == name, f"typedef struct {name} {{...}} {tail}"
        assert "{" not in body, f"{name}: nested struct bodies are not parsed by this test"
        fields = []
        for decl in body.split(";"):
            fields += _decl_names(decl)
        out[name] = fields
    return out


def test_header_has_structs():
    structs = _structs()
    for name in ("clmha_layer_desc", "clmha_forward_args", "clmha_tensor", "clmha_mask",
                 "clmha_backward_args", "clmha_device_info"):
        assert name in structs
    assert len(structs) >= 10


@pytest.mark.parametrize("name", sorted(_structs()))
def test_struct_layout_matches_header(name):
    header_fields = _structs()[name]
    cffi_fields = [f[0] for f in ffi.typeof(name).fields]
    assert cffi_fields == header_fields
    assert ffi.sizeof(name) > 0


def test_status_map():
    text = _header("clmha.h")
    start = text.index("#define CLMHA_STATUS_MAP(X)")
    block = []
    for line in text[start:].splitlines()[1:]:
        if not line.strip().startswith("X("):
            break
        block.append(line)
    entries = re.findall(r"X\((\w+),\s*(-?\d+),", "\n".join(block))
    assert len(entries) >= 5
    for name, value in entries:
        assert name in clmha.STATUS, name
        assert clmha.STATUS[name] == int(value), name
    assert set(clmha.STATUS) == {n for n, _ in entries}


def test_version_matches_header():
    m = re.search(r'#define\s+CLMHA_VERSION_STRING\s+"([^"]+)"', _header("clmha_version.h"))
    assert m
    assert clmha.__version__ == m.group(1)
    parts = [re.search(rf"#define\s+CLMHA_VERSION_{p}\s+(\d+)", _header("clmha_version.h"))
             .group(1) for p in ("MAJOR", "MINOR", "PATCH")]
    assert clmha.__version__.startswith(".".join(parts))


def test_error_attributes():
    e = clmha.Error(clmha.STATUS["SHAPE_MISMATCH"], "query: bad")
    assert e.status == clmha.STATUS["SHAPE_MISMATCH"]
    assert e.status_name == "SHAPE_MISMATCH"
    assert e.message == "query: bad"
    assert "query: bad" in str(e)
