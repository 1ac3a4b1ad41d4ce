"""deploy/ checked by schema validators from PyPI, offline (#28 item 4): the Kubernetes manifests by
kubernetes-validate (the Kubernetes JSON schemas ship inside the package; strict: an unknown field is an
error), the compose file by compose-spec (the Compose specification's parser: unknown keys, enums,
durations, ports), after the interpolation and YAML merge keys Docker Compose applies itself. Each
validator is shown to refuse a broken copy, so a pass means something."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
import yaml
from compose_spec import PyCompose

from tests.conftest import REPO

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.33"  # a version the manifests must hold for (the package ships the schemas of many)


def _documents(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kubernetes(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_each_kubernetes_manifest_holds_to_its_schema(path):
    docs = _documents(path)
    assert docs, path
    for doc in docs:
        _kubernetes(doc)


def test_the_kustomization_lists_every_manifest_and_nothing_else():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]


def test_the_kubernetes_validator_refuses_a_broken_manifest():
    worker = next(d for p in MANIFESTS for d in _documents(p) if d["kind"] == "Deployment")
    container = worker["spec"]["template"]["spec"]["containers"][0]
    typo = json.loads(json.dumps(worker))
    typo["spec"]["template"]["spec"]["containers"][0] = {**container, "imagePullPolcy": "Always"}
    wrong_type = json.loads(json.dumps(worker))
    wrong_type["spec"]["replicas"] = "two"
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            _kubernetes(broken)


def _compose(text: str) -> dict:
    """What Docker Compose validates: variables replaced by their defaults (`${X:-default}`; `${X}` by a
    placeholder), YAML merge keys resolved, the `x-` extension fields dropped."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), text)
    text = re.sub(r"\$\{(\w+)\}", "placeholder", text)
    return {k: v for k, v in yaml.safe_load(text).items() if not k.startswith("x-")}


def _check_compose(doc: dict) -> None:
    PyCompose.from_json(json.dumps(doc)).to_spec()
    services = set(doc["services"])
    for name, service in doc["services"].items():  # the one cross-reference the schema cannot see
        needs = service.get("depends_on", {})
        missing = sorted(set(needs) - services)
        if missing:
            raise ValueError(f"service {name} depends on unknown services {missing}")


def test_the_compose_file_holds_to_the_compose_specification():
    doc = _compose((DEPLOY / "compose.yaml").read_text())
    _check_compose(doc)
    assert {"temporal", "worker-workflows", "worker-agents", "worker-gpu-0"} <= set(doc["services"])


@pytest.mark.parametrize("mistake, says", [
    ({"restrat": "always"}, "restrat"),
    ({"restart": "sometimes"}, "sometimes"),
    ({"stop_grace_period": "eleven minutes"}, "duration"),
    ({"depends_on": {"temporall": {"condition": "service_healthy"}}}, "temporall"),
])  # fmt: skip
def test_the_compose_check_refuses_a_broken_service(mistake, says):
    doc = _compose((DEPLOY / "compose.yaml").read_text())
    doc["services"]["worker-agents"] = {**doc["services"]["worker-agents"], **mistake}
    with pytest.raises(ValueError, match=says):
        _check_compose(doc)
