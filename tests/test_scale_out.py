"""deploy/kserve/ checked offline, as far as what installs here can check it (docs/scale-out.md,
"What the tests check and what they do not").

Checked:
* every file parses as YAML, each document names its apiVersion, kind and metadata.name;
* core kinds (the ConfigMaps) against Kubernetes' published OpenAPI schemas, strict (an unknown
  field is an error), as kubernetes-validate ships them for ``K8S_VERSION``;
* KServe kinds: every field name and JSON type against the field table of the KServe SDK's
  generated models (tests/data/kserve_fields.json, written by tools/kserve_fields.py), and every
  Kubernetes object inside them (containers, probes, volumes, resources, metadata) against
  Kubernetes' strict schemas;
* what shmserve would do with them, through its own code so it cannot drift: the container args
  parse with shmserve's parser and pass serve's address checks, the TOML in shmserve-config
  passes ``config.parse``, the /dev/shm volume holds the arena that configuration lays out, and
  the ports, uids, probes, annotations and shutdown times agree with each other.

Not checked (nothing installable here can): KServe's CRD-level rules (enums, CEL, defaults) and
webhooks, Knative's field masks and feature flags, Envoy's own config validation, the PodMonitor
(the Prometheus Operator's CRDs are not packaged).
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import re
import tomllib
from fractions import Fraction
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from shmserve import config as cfg
from shmserve import layout
from shmserve.arena import Arena
from shmserve.cli import _listen_address_problem, build_parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kserve"
DOC = ROOT / "docs" / "scale-out.md"
FIELDS = json.loads((Path(__file__).parent / "data" / "kserve_fields.json").read_text())

K8S_VERSION = "1.33"  # KServe 0.16 and newer run on it; lifecycle.preStop.sleep is there (beta since 1.30)
KSERVE_KINDS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
                ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
                ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}
UNCHECKED_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}  # no schema installable: said in the doc
CORE_API_VERSIONS = {"v1", "apps/v1"}  # kubernetes-validate has these
KSERVE_CONTAINER = "kserve-container"  # KServe's name for the runtime's serving container
# Knative's queue-proxy runs as its image's user: ko-built on a distroless :nonroot base
# (knative/serving .ko.yaml), uid 65532; its securityContext sets no runAsUser.
QUEUE_PROXY_UID = 65532
QPEXT_PORT_NAME = "aggr-metric"  # KServe's constants.AggregateMetricsPortName (qpext, port 9088)
READY, LIVE = "/v2/health/ready", "/v2/health/live"
STANDARD_MODES, KNATIVE_MODES = {"Standard", "RawDeployment"}, {"Knative", "Serverless"}


# -- loading -----------------------------------------------------------------------------------

def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


DOCS = documents()


def only(kind: str, name: str | None = None) -> list[dict]:
    return [d for _, d in DOCS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def config_map(name: str) -> dict:
    found = only("ConfigMap", name)
    assert len(found) == 1, f"deploy/kserve has {len(found)} ConfigMaps named {name!r}"
    return found[0]


def container(runtime: dict, name: str) -> dict:
    found = [c for c in runtime["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"{runtime['metadata']['name']}: {len(found)} containers named {name!r}"
    return found[0]


def proxy_of(runtime: dict) -> dict | None:
    """The sidecar proxy of a runtime (Standard mode), or None (Knative: queue-proxy is Knative's)."""
    others = [c for c in runtime["spec"]["containers"] if c["name"] != KSERVE_CONTAINER]
    assert len(others) <= 1, "one proxy at most"
    return others[0] if others else None


def quantity(text) -> Fraction:
    """A Kubernetes quantity (``512Mi``, ``8Gi``, ``500m``, ``2``) as a number."""
    m = re.fullmatch(r"([0-9.]+)(Ki|Mi|Gi|Ti|m|k|M|G|T)?", str(text))
    assert m, f"not a quantity: {text!r}"
    scale = {None: 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]
    return Fraction(m.group(1)) * scale


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def serve_args(runtime: dict) -> argparse.Namespace:
    """The kserve-container's command line, parsed by shmserve's own parser (argparse exits on a
    flag serve does not take)."""
    c = container(runtime, KSERVE_CONTAINER)
    assert c["command"] == ["shmserve"], c["command"]
    try:
        args = build_parser().parse_args(c["args"])
    except SystemExit as exc:
        pytest.fail(f"{runtime['metadata']['name']}: shmserve {' '.join(c['args'])} is refused (exit {exc.code})")
    assert args.command == "serve"
    return args


def server_config(runtime: dict, tmp_path: Path) -> cfg.ServerConfig:
    """The ServerConfig the runtime's pod would run: its --config file from the ConfigMap it
    mounts, through ``config.parse``.  ``model_repository`` is the one path the pod has and this
    machine has not: it is pointed at an empty directory here."""
    args = serve_args(runtime)
    c = container(runtime, KSERVE_CONTAINER)
    mount = next(m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in runtime["spec"]["volumes"] if v["name"] == mount["name"])
    data = config_map(volume["configMap"]["name"])["data"]
    raw = tomllib.loads(data[Path(args.config).name])
    assert raw["server"]["model_repository"] == "/mnt/models", "KServe's storage initializer writes /mnt/models"
    raw["server"]["model_repository"] = str(tmp_path)
    return cfg.parse(raw, base_dir=tmp_path)


# -- schemas -----------------------------------------------------------------------------------

def _definitions():
    base = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    folder = next(p for p in base.iterdir() if p.name == f"v{K8S_VERSION}.0-local-strict")
    defs = json.loads((folder / "_definitions.json").read_text())
    return defs, Registry().with_resource(defs["$id"], Resource.from_contents(defs))


DEFINITIONS, REGISTRY = _definitions()
_validators: dict[str, jsonschema.protocols.Validator] = {}


def k8s_definition(sdk_name: str) -> str:
    """The Kubernetes OpenAPI definition an SDK type name stands for (``V1Container`` ->
    ``io.k8s.api.core.v1.Container``, ``K8sIoApiAppsV1DeploymentStrategy`` -> ``io.k8s.api.apps.v1
    .DeploymentStrategy``, ``ResourceQuantity`` -> the quantity)."""
    if sdk_name == "ResourceQuantity":
        return "io.k8s.apimachinery.pkg.api.resource.Quantity"
    m = re.fullmatch(r"K8sIoApi([A-Z][a-z]+)(V\d+(?:alpha\d+|beta\d+)?)([A-Z]\w*)", sdk_name)
    if m:
        candidates = [f"io.k8s.api.{m[1].lower()}.{m[2].lower()}.{m[3]}"]
    else:
        m = re.fullmatch(r"(V\d+(?:alpha\d+|beta\d+)?)([A-Z]\w*)", sdk_name)
        assert m, f"no Kubernetes definition for the SDK type {sdk_name!r}"
        version = m[1].lower()
        candidates = [f"io.k8s.api.core.{version}.{m[2]}", f"io.k8s.apimachinery.pkg.apis.meta.{version}.{m[2]}"]
    found = [c for c in candidates if c in DEFINITIONS["$defs"]]
    assert found, f"{sdk_name}: none of {candidates} in Kubernetes {K8S_VERSION}'s schemas"
    return found[0]


def k8s_problems(value, sdk_name: str, where: str) -> list[str]:
    definition = k8s_definition(sdk_name)
    if definition not in _validators:
        _validators[definition] = jsonschema.Draft202012Validator(
            {"$ref": f"{DEFINITIONS['$id']}#/$defs/{definition}"}, registry=REGISTRY)
    return [f"{where}{e.json_path[1:]}: {e.message}" for e in _validators[definition].iter_errors(value)]


SCALARS = {"str": str, "bool": bool, "int": int, "float": (int, float)}


def kserve_problems(value, type_string: str, where: str) -> list[str]:
    """Every field of ``value`` against the SDK's table for ``type_string``; Kubernetes types
    against Kubernetes' schemas."""
    if type_string == "object":
        return []
    if type_string in SCALARS:
        ok = isinstance(value, SCALARS[type_string]) and not (type_string != "bool" and isinstance(value, bool))
        return [] if ok else [f"{where}: expected {type_string}, got {value!r}"]
    m = re.fullmatch(r"list\[(.+)\]", type_string)
    if m:
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [p for i, v in enumerate(value) for p in kserve_problems(v, m[1], f"{where}[{i}]")]
    m = re.fullmatch(r"dict\(str, (.+)\)", type_string)
    if m:
        if not isinstance(value, dict):
            return [f"{where}: expected a mapping"]
        return [p for k, v in value.items() for p in kserve_problems(v, m[1], f"{where}.{k}")]
    table = FIELDS["types"].get(type_string)
    if table is None:
        return k8s_problems(value, type_string, where)
    if not isinstance(value, dict):
        return [f"{where}: expected a {type_string} mapping"]
    problems = [f"{where}.{k}: not a field of {type_string}" for k in value if k not in table["fields"]]
    problems += [f"{where}: {type_string} needs {k}" for k in table["required"] if k not in value]
    for k, v in value.items():
        if k in table["fields"]:
            problems += kserve_problems(v, table["fields"][k], f"{where}.{k}")
    return problems


# -- the documents against the published schemas -----------------------------------------------------

def test_every_document_is_a_kind_this_test_knows():
    assert DOCS, "deploy/kserve/*.yaml holds no document"
    for path, doc in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path
        assert doc["metadata"].get("name"), path
        key = (doc["apiVersion"], doc["kind"])
        assert key in KSERVE_KINDS or key in UNCHECKED_KINDS or doc["apiVersion"] in CORE_API_VERSIONS, \
            f"{path}: no check for {key}"
    assert only("ServingRuntime") and only("InferenceService") and only("ConfigMap")


@pytest.mark.parametrize("path,doc", [(p, d) for p, d in DOCS if d["apiVersion"] in CORE_API_VERSIONS],
                         ids=lambda x: x if isinstance(x, str) else x["metadata"]["name"])
def test_core_kinds_match_the_published_kubernetes_schemas(path, doc):
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{path}: {exc.json_path}: {exc.message}")


@pytest.mark.parametrize("path,doc", [(p, d) for p, d in DOCS if (d["apiVersion"], d["kind"]) in KSERVE_KINDS],
                         ids=lambda x: x if isinstance(x, str) else x["metadata"]["name"])
def test_kserve_kinds_match_the_sdk_field_table_and_the_kubernetes_schemas(path, doc):
    problems = kserve_problems(doc, KSERVE_KINDS[doc["apiVersion"], doc["kind"]], doc["kind"])
    assert not problems, f"{path}:\n" + "\n".join(problems)


def test_the_checks_catch_the_mistakes_they_are_for():
    """The checker itself: a misspelt KServe field, a misspelt container field, a wrong type and
    an unknown volume source are each reported."""
    runtime = only("ServingRuntime", "shmserve")[0]
    spec = runtime["spec"]
    c = spec["containers"][0]
    bad = {**runtime, "spec": {**spec, "protocolVersion": ["v2"],
                               "containers": [{**c, "readinessprobe": {}, "ports": [{"containerPort": "8000"}]}],
                               "volumes": [{"name": "x", "ramDisk": {}}]}}
    found = "\n".join(kserve_problems(bad, "V1alpha1ServingRuntime", "ServingRuntime"))
    assert "spec.protocolVersion: not a field" in found
    assert "readinessprobe" in found and "'8000' is not of type 'integer'" in found and "ramDisk" in found


# -- the documents against shmserve and each other ---------------------------------------------------

RUNTIMES = {r["metadata"]["name"]: r for r in only("ServingRuntime")}


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_the_runtime_runs_a_command_shmserve_accepts(name, tmp_path):
    runtime = RUNTIMES[name]
    args = serve_args(runtime)
    assert args.config and args.strict
    for flag, address in (("--http", args.http), ("--grpc", args.grpc), ("--metrics", args.metrics)):
        assert address, f"{name}: no {flag}"
        assert _listen_address_problem(address) is None, f"{name}: {flag} {address}"
        assert address.startswith("127.0.0.1:"), f"{name}: {flag} {address}: the proxy dials 127.0.0.1"
    server = server_config(runtime, tmp_path)
    assert not server.v2_system_shared_memory
    assert not server.admin_uids and not server.admin_gids, "remote callers must not be admins"
    # remote callers arrive over loopback TCP through the proxy: anonymous, with what this grants
    assert {"infer", "metadata"} <= set(server.v2_anonymous), "remote callers could not infer"


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_dev_shm_holds_the_arena_and_the_memory_limit_holds_dev_shm(name, tmp_path, monkeypatch):
    """The arena lives in /dev/shm: the emptyDir there must hold the arena this configuration lays
    out, found by running the server's own Arena.create up to its layout step."""
    runtime = RUNTIMES[name]
    server = server_config(runtime, tmp_path)
    geometry = {}

    class Planned(Exception):
        pass

    real_plan = layout.plan

    def plan(**kw):
        geometry["g"] = real_plan(**kw)
        raise Planned  # before anything is created in /dev/shm

    monkeypatch.setattr(layout, "plan", plan)
    n_workers = max(server.max_workers, sum(m.instances for m in server.models))  # as Frontend._build does
    with pytest.raises(Planned):
        Arena.create(server.instance, slot_count=server.arena_slots, max_workers=n_workers,
                     size_classes=server.arena_size_classes(), max_regions=server.max_regions)
    arena_bytes = geometry["g"].total_size
    c = container(runtime, KSERVE_CONTAINER)
    mount = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(mount) == 1, f"{name}: nothing mounted at /dev/shm (a container's own is 64 MiB)"
    volume = next(v for v in runtime["spec"]["volumes"] if v["name"] == mount[0]["name"])
    assert volume["emptyDir"]["medium"] == "Memory"
    size = quantity(volume["emptyDir"]["sizeLimit"])
    assert size >= arena_bytes, f"{name}: /dev/shm {size} bytes < the arena's {arena_bytes}"
    limits = [quantity(c["resources"]["limits"]["memory"])]
    for isvc in only("InferenceService"):
        if isvc["spec"]["predictor"]["model"]["runtime"] == name:
            limits.append(quantity(isvc["spec"]["predictor"]["model"]["resources"]["limits"]["memory"]))
    for limit in limits:  # tmpfs pages are charged to the container's memory
        assert limit >= size + quantity("1Gi"), f"{name}: memory limit {limit} leaves too little beside /dev/shm"


def probe_url(probe: dict) -> str:
    """The URL an exec probe's ``python3 -c`` fetches (compiled first: it must be Python)."""
    command = probe["exec"]["command"]
    assert command[:2] == ["python3", "-c"], command
    compile(command[2], "<probe>", "exec")
    m = re.search(r"urlopen\('([^']+)'", command[2])
    assert m, command[2]
    return m.group(1)


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_probes_ask_the_v2_health_routes_where_they_can_reach_shmserve(name, tmp_path):
    runtime = RUNTIMES[name]
    args = serve_args(runtime)
    c = container(runtime, KSERVE_CONTAINER)
    v2_doc = (ROOT / "docs" / "v2.md").read_text()
    assert f"`GET {LIVE}`" in v2_doc and f"`{READY}`" in v2_doc
    for kind in ("livenessProbe", "startupProbe"):  # the kubelet runs these: inside the container
        assert probe_url(c[kind]) == f"http://{args.http}{LIVE}", f"{name}: {kind}"
    ready = c["readinessProbe"]["httpGet"]
    assert ready["path"] == READY
    proxy = proxy_of(runtime)
    if proxy is None:  # Knative: queue-proxy runs it against 127.0.0.1:<port>
        assert ready["port"] == port_of(args.http)
    else:  # the kubelet sends it to the pod IP: it must be a port the proxy forwards to --http
        assert listeners(runtime)[ready["port"]] == args.http
        assert proxy["livenessProbe"]["tcpSocket"]["port"] == ready["port"]
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300, \
        "models load before any socket opens: give the start minutes"


def test_knative_runtime_exposes_shmserve_where_queue_proxy_forwards(tmp_path):
    for name, runtime in RUNTIMES.items():
        if proxy_of(runtime) is not None:
            continue
        args = serve_args(runtime)
        c = container(runtime, KSERVE_CONTAINER)
        assert len(c["ports"]) == 1, "Knative takes one port"
        port = c["ports"][0]
        wanted = args.grpc if port["name"] == "h2c" else args.http
        assert port["containerPort"] == port_of(wanted), f"{name}: queue-proxy dials 127.0.0.1:{port['containerPort']}"
        assert "lifecycle" not in c, "Knative sets the user container's lifecycle itself"
        assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(port_of(args.metrics))
        assert c["securityContext"]["runAsUser"] not in (0, QUEUE_PROXY_UID)


def envoy_config(runtime: dict) -> dict:
    proxy = proxy_of(runtime)
    mount = next(m for m in proxy["volumeMounts"] if m["mountPath"] == "/etc/envoy")
    volume = next(v for v in runtime["spec"]["volumes"] if v["name"] == mount["name"])
    config_file = proxy["args"][proxy["args"].index("-c") + 1]
    assert config_file.startswith("/etc/envoy/")
    return yaml.safe_load(config_map(volume["configMap"]["name"])["data"][Path(config_file).name])


def listeners(runtime: dict) -> dict[int, str]:
    """{pod port: the host:port its envoy cluster forwards to}."""
    envoy = envoy_config(runtime)["static_resources"]
    endpoints = {}
    for cluster in envoy["clusters"]:
        (group,) = cluster["load_assignment"]["endpoints"]
        (lb,) = group["lb_endpoints"]
        sock = lb["endpoint"]["address"]["socket_address"]
        assert cluster["load_assignment"]["cluster_name"] == cluster["name"]
        endpoints[cluster["name"]] = f"{sock['address']}:{sock['port_value']}"
    out = {}
    for listener in envoy["listeners"]:
        sock = listener["address"]["socket_address"]
        assert sock["address"] == "0.0.0.0", "the proxy serves the pod's address"
        (chain,) = listener["filter_chains"]
        (flt,) = chain["filters"]
        conf = flt["typed_config"]
        if "cluster" in conf:  # tcp_proxy
            targets = {conf["cluster"]}
        else:
            routes = [r for vh in conf["route_config"]["virtual_hosts"] for r in vh["routes"]]
            targets = {r["route"]["cluster"] for r in routes if "route" in r}
        (target,) = targets
        out[sock["port_value"]] = endpoints[target]
    return out


def test_standard_runtime_sidecar_forwards_the_pod_ports_to_shmserve(tmp_path):
    standard = [r for r in RUNTIMES.values() if proxy_of(r) is not None]
    assert standard, "a Standard-mode runtime with its proxy"
    for runtime in standard:
        name = runtime["metadata"]["name"]
        args = serve_args(runtime)
        server = server_config(runtime, tmp_path)
        c, proxy = container(runtime, KSERVE_CONTAINER), proxy_of(runtime)
        forward = listeners(runtime)
        assert sorted(forward.values()) == sorted([args.http, args.grpc, args.metrics]), f"{name}: {forward}"
        declared = [p["containerPort"] for p in c["ports"]]
        assert forward[declared[0]] == args.http, "KServe's Service port 80 goes to the first port: HTTP"
        assert all(p in forward for p in declared), f"{name}: a Service port nobody listens on"
        grpc = [p for p in c["ports"] if forward[p["containerPort"]] == args.grpc]
        assert grpc and "grpc" in grpc[0]["name"], "KServe marks a port h2c by its name"
        (metrics,) = [p for p in proxy["ports"] if p["name"] == "metrics"]
        assert forward[metrics["containerPort"]] == args.metrics
        assert runtime["spec"]["annotations"]["prometheus.io/port"] == str(metrics["containerPort"])
        uid = proxy["securityContext"]["runAsUser"]
        assert uid not in (0, c["securityContext"]["runAsUser"]), "the proxy must not run as the server's uid or root"
        http = next(cl for cl in envoy_config(runtime)["static_resources"]["clusters"]
                    if port_of(args.http) == cl["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
                    ["endpoint"]["address"]["socket_address"]["port_value"])
        assert http["circuit_breakers"]["thresholds"][0]["max_connections"] < server.max_connections
        own, theirs = (x["lifecycle"]["preStop"]["sleep"]["seconds"] for x in (c, proxy))
        assert theirs >= own + server.drain_timeout_s, "the proxy must outlive shmserve's drain"
        for isvc in only("InferenceService"):
            if isvc["spec"]["predictor"]["model"]["runtime"] == name:
                assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > theirs


def test_inference_services_name_runtimes_here_that_take_their_model():
    for isvc in only("InferenceService"):
        name, predictor = isvc["metadata"]["name"], isvc["spec"]["predictor"]
        model = predictor["model"]
        runtime = RUNTIMES[model["runtime"]]
        spec = runtime["spec"]
        assert model["modelFormat"] in [{"name": f["name"], "version": f["version"]}
                                        for f in spec["supportedModelFormats"]], name
        assert model["protocolVersion"] in spec["protocolVersions"], name
        assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
        mode = isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"]
        if proxy_of(runtime) is None:
            assert mode in KNATIVE_MODES, f"{name}: {model['runtime']} has no proxy for {mode} mode"
            assert predictor["minReplicas"] >= 1, "from zero a request waits for every model to load"
            assert predictor["containerConcurrency"] <= 256  # below max_connections and max_inflight_per_uid
        else:
            assert mode in STANDARD_MODES, f"{name}: {model['runtime']} carries a proxy Knative does not want"


def test_pod_monitor_scrapes_ports_the_pods_have():
    (monitor,) = only("PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {p["name"] for r in RUNTIMES.values() for c in r["spec"]["containers"] for p in c.get("ports", [])}
    ports.add(QPEXT_PORT_NAME)  # added to queue-proxy by KServe's webhook in Knative mode
    for runtime in RUNTIMES.values():
        assert selector.items() <= runtime["spec"]["labels"].items()
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in ports


# -- the page ----------------------------------------------------------------------------------

def test_scale_out_doc_names_every_manifest_and_its_commands_parse():
    text = DOC.read_text()
    for path in sorted(DEPLOY.glob("*.yaml")):
        assert f"deploy/kserve/{path.name}" in text, f"docs/scale-out.md does not mention {path.name}"
    commands = [line.split("#")[0].strip() for block in re.findall(r"```sh\n(.*?)```", text, re.S)
                for line in block.splitlines() if line.strip().startswith("shmserve ")]
    assert commands
    for command in commands:
        words = command.split()[1:]
        try:
            build_parser().parse_args(words)
        except SystemExit as exc:
            pytest.fail(f"docs/scale-out.md: {command!r} is refused by shmserve's parser (exit {exc.code})")


# -- the image the runtimes run (issue 28 item 6) -----------------------------------------------

def dockerfile() -> dict:
    """The Dockerfile's final stage as tools/check_image.py reads it (its parser: the same one that
    runs the RUN steps)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_image", ROOT / "tools" / "check_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stages, args = module.stages((ROOT / "Dockerfile").read_text(), {})
    return {"final": stages[-1], "stages": stages, "args": args}


@pytest.mark.parametrize("name", sorted(RUNTIMES))
def test_the_runtimes_run_the_image_the_dockerfile_builds(name):
    """The manifests name an image the Dockerfile makes: its tag (the package's version, as the doc's
    build command tags it), its user (non-root, the runtime's securityContext), its command on the
    PATH it sets (the probes' python3 too), /dev/shm as the doc says; and the section they point to."""
    from shmserve import __version__

    image = dockerfile()
    final = image["final"]
    box = container(RUNTIMES[name], KSERVE_CONTAINER)
    doc = (ROOT / "docs" / "scale-out.md").read_text()
    assert box["image"] == f"shmserve:{__version__}"
    assert f"docker build -t {box['image']} ." in doc
    assert '"The image"' in (DEPLOY / f"servingruntime-{'knative' if name == 'shmserve' else 'standard'}.yaml"
                             ).read_text() and "\n## The image\n" in doc
    uid, _, gid = final["user"].partition(":")
    security = box["securityContext"]
    assert (int(uid), int(gid)) == (security["runAsUser"], security["runAsGroup"]) and int(uid) != 0
    assert box["command"] == final["entrypoint"] == ["shmserve"]
    assert final["env"]["PATH"].startswith("/opt/shmserve/bin:") and final["env"]["PYTHONDONTWRITEBYTECODE"] == "1"
    for probe in ("startupProbe", "livenessProbe"):
        assert box[probe]["exec"]["command"][0] == "python3"  # the environment's, first on PATH
    dshm = next(v for v in RUNTIMES[name]["spec"]["volumes"] if v["name"] == "dshm")
    assert f"sizeLimit: {dshm['emptyDir']['sizeLimit']}" in doc and "--shm-size=512m" in doc
    assert quantity(dshm["emptyDir"]["sizeLimit"]) >= quantity("512Mi")
    assert image["args"]["VARIANT"] == "cpu"  # CPU by default; VARIANT=cuda the other
    assert {s["name"] for s in image["stages"]} >= {"base-cpu", "base-cuda", "build"}


def test_no_page_points_outside_the_repository():
    """docs/scale-out.md linked a file outside the repository (a dead end for whoever has only
    the clone): no page of docs/ or the README names a path above the repository's root."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)]+)\)", text) + re.findall(r"`([^`\s]+)`", text):
            path = target.split("#")[0]
            if path.startswith(("../", "/")) and "/" in path[1:] and not path.startswith(("/dev/", "/etc/", "/run/",
                                                                                         "/tmp/", "/opt/", "/var/",
                                                                                         "/usr/", "/proc/", "/sys/",
                                                                                         "/mnt/", "/v2/", "/home/")):
                resolved = (page.parent / path).resolve()
                assert resolved.is_relative_to(ROOT) and resolved.exists(), \
                    f"{page.name} points outside the repository: {target}"
