"""Rebuild the two schema files beside this script from their published sources (see README.md here).

    python tests/data/k8s-schemas/vendor.py K8S_SCHEMA_DIR LWS_CRD_YAML

K8S_SCHEMA_DIR: `kubernetes_validate/kubernetes-json-schema/v1.37.0-local-strict` from the kubernetes-validate
1.37.0 wheel (`pip download kubernetes-validate==1.37.0 --no-deps`, then unzip). LWS_CRD_YAML:
`config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml` of kubernetes-sigs/lws at tag v0.10.0.

What changes on the way, and nothing else: only the definitions that Service, PodTemplateSpec and ObjectMeta reach
are kept (the whole set is 1.8 MB), their `$ref`s point into the one output file, and `description` texts are
dropped (half the size of the CRD; no validation keyword reads them). A property that is itself called
`description` is kept: only the keyword is dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CORE_OUT = HERE / "k8s-v1.37.0-strict.json"
LWS_OUT = HERE / "lws-v0.10.0-openapiv3.json"
K8S_REF = "/api/_definitions.json#/$defs/"  # the root files' references; the definitions also use local ones
LOCAL_REF = "#/$defs/"
ROOTS = {"service-v1": "service-v1.json", "podtemplatespec-v1": "podtemplatespec-v1.json"}
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def undescribed(node: Any, *, names: bool = False) -> Any:
    """The schema without `description` keywords; under `properties` (names=True) every key is a field name."""
    if isinstance(node, dict):
        return {k: undescribed(v, names=k in ("properties", "patternProperties", "$defs") and not names)
                for k, v in node.items() if names or k != "description"}
    if isinstance(node, list):
        return [undescribed(v) for v in node]
    return node


def refs(node: Any) -> set[str]:
    """Definition names a schema's `$ref`s point at."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        own = {ref.removeprefix(K8S_REF).removeprefix(LOCAL_REF)} if isinstance(ref, str) else set()
        return own.union(*(refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(v) for v in node))
    return set()


def local_refs(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: (v.replace(K8S_REF, LOCAL_REF) if k == "$ref" else local_refs(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [local_refs(v) for v in node]
    return node


def core(schema_dir: Path) -> dict[str, Any]:
    defs = json.loads((schema_dir / "_definitions.json").read_text())["$defs"]
    roots = {name: json.loads((schema_dir / file).read_text()) for name, file in ROOTS.items()}
    for root in roots.values():
        root.pop("$schema", None)
        root.pop("$id", None)
    todo, kept = set().union(*(refs(r) for r in roots.values())) | {OBJECT_META}, set()
    while todo:
        name = todo.pop()
        kept.add(name)
        todo |= refs(defs[name]) - kept
    out = {**roots, **{name: defs[name] for name in sorted(kept)}}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$comment": "kubernetes-validate 1.37.0, v1.37.0-local-strict: service-v1, podtemplatespec-v1 and the "
                        "definitions they reach; descriptions dropped (tests/data/k8s-schemas/vendor.py)",
            "$defs": local_refs(undescribed(out, names=True))}


def lws(crd_yaml: Path) -> dict[str, Any]:
    crd = yaml.safe_load(crd_yaml.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = undescribed(version["schema"]["openAPIV3Schema"])
    return {"$comment": "kubernetes-sigs/lws v0.10.0, config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml: "
                        "spec.versions[v1].schema.openAPIV3Schema, descriptions dropped "
                        "(tests/data/k8s-schemas/vendor.py)", **schema}


def main() -> int:
    schema_dir, crd_yaml = Path(sys.argv[1]), Path(sys.argv[2])
    for path, data in ((CORE_OUT, core(schema_dir)), (LWS_OUT, lws(crd_yaml))):
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n", encoding="utf-8")
        print(f"{path.name}: {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
