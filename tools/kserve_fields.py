#!/usr/bin/env python3
"""Write the field table that tests/test_scale_out.py checks the KServe manifests against.

Why this exists: no package that installs here ships KServe's CRD schemas
(config/crd/full/serving.kserve.io_*.yaml in the KServe repository).  The
KServe Python SDK on PyPI ships, instead, classes generated from KServe's
OpenAPI spec (the same Go types the CRDs are generated from): each has an
``openapi_types`` table (attribute -> type), an ``attribute_map`` (attribute
-> JSON name) and setters that refuse ``None`` for required fields.  The SDK
itself is too heavy for the test extra (its import pulls fastapi, pandas,
grpcio-tools and more), so this tool reads those tables from the wheel's
source with ``ast`` -- nothing of it is imported or run -- and writes the
part reachable from the kinds deploy/kserve/ uses, status left out.

Usage (in a scratch directory; needs network to the package index once):

    python -m pip download --no-deps 'kserve==0.21.0' -d /tmp/kserve-wheel
    python tools/kserve_fields.py /tmp/kserve-wheel/kserve-0.21.0-py3-none-any.whl \
        > tests/data/kserve_fields.json

Owns: reading the generated model sources.  Must not: import the SDK.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile

ROOTS = ("V1alpha1ServingRuntime", "V1alpha1ClusterServingRuntime", "V1beta1InferenceService")
SKIP_FIELDS = {"status"}  # written by the controllers, never in a manifest
REQUIRED = re.compile(r"Invalid value for `(\w+)`, must not be `None`")
NAMED = re.compile(r"[A-Z]\w*")  # class names inside 'list[V1Container]', 'dict(str, V1beta1Foo)'


def models_of(wheel: str) -> tuple[str, dict[str, str]]:
    """(the wheel's version, {module file name: source}) of kserve/models/ in ``wheel``."""
    with zipfile.ZipFile(wheel) as z:
        version = next(m[1] for n in z.namelist() if (m := re.fullmatch(r"kserve-(.+)\.dist-info/METADATA", n)))
        sources = {n.rsplit("/", 1)[1]: z.read(n).decode() for n in z.namelist()
                   if n.startswith("kserve/models/") and n.endswith(".py")}
    return version, sources


def classes_in(sources: dict[str, str]) -> dict[str, dict]:
    """{class name: {"fields": {json name: type string}, "required": [json names]}}."""
    out = {}
    for source in sources.values():
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef):
                continue
            tables = {}
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and \
                        isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id in ("openapi_types", "attribute_map"):
                    tables[stmt.targets[0].id] = ast.literal_eval(stmt.value)
            if set(tables) != {"openapi_types", "attribute_map"}:
                continue
            types, names = tables["openapi_types"], tables["attribute_map"]
            required = sorted(names[a] for a in set(REQUIRED.findall(ast.get_source_segment(source, node))) if a in names)
            out[node.name] = {"fields": {names[a]: t for a, t in sorted(types.items())}, "required": required}
    return out


def reachable(classes: dict[str, dict]) -> dict[str, dict]:
    """The KServe classes reachable from ``ROOTS`` (Kubernetes' own V1* types stay names: the test
    checks those against Kubernetes' published schemas)."""
    keep, todo = {}, list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep or name not in classes:
            continue
        entry = classes[name]
        entry["fields"] = {k: v for k, v in entry["fields"].items() if k not in SKIP_FIELDS}
        keep[name] = entry
        for type_string in entry["fields"].values():
            todo += [n for n in NAMED.findall(type_string) if n in classes]
    return dict(sorted(keep.items()))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    version, sources = models_of(argv[0])
    table = {"source": f"kserve {version} (PyPI wheel): kserve/models/*.py openapi_types, attribute_map, "
                       f"and the setters that refuse None; read by tools/kserve_fields.py",
             "roots": list(ROOTS), "types": reachable(classes_in(sources))}
    json.dump(table, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
