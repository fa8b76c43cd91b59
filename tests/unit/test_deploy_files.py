"""Deployment files (docker-compose.yml, ops/) parse and agree with each other and with the config.

No Docker engine, Apache Kafka, Collector, Jaeger, Prometheus or Grafana runs here: these checks are by parsing
only (docs/operations.md says so). They catch what breaks a stack silently: a renamed service, a port that no
longer matches, an environment variable naming no config field, a dashboard query on a metric nobody exports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from support.paths import REPO_ROOT

from stream_rl.cli.config import StreamRLConfig, load_config

ROOT = REPO_ROOT
COMPOSE = ROOT / "docker-compose.yml"
DASHBOARD = ROOT / "ops" / "grafana" / "dashboards" / "stream-rl.json"
ROLE_COMMANDS = {"produce": "producer", "score": "scorer", "train": "trainer"}

# The Prometheus metric contract of issue 5 (exported by stream_rl/telemetry/metrics.py; it keeps no list of its
# own, so the list lives here and test_contract_metrics_are_exported checks it against that module's source).
CONTRACT_METRICS = frozenset({
    "stream_rl_records_in_total", "stream_rl_records_out_total", "stream_rl_tokens_total",
    "stream_rl_processing_seconds", "stream_rl_consumer_lag_records", "stream_rl_staleness_versions",
    "stream_rl_process_rss_bytes", "stream_rl_gpu_memory_allocated_bytes", "stream_rl_gpu_memory_reserved_bytes",
    "stream_rl_errors_total", "stream_rl_dead_letters_total", "stream_rl_restarts_total", "stream_rl_policy_version",
    "stream_rl_trainer_step", "stream_rl_trainer_metric", "stream_rl_alerts_firing"})
CONTRACT_HISTOGRAMS = frozenset({"stream_rl_processing_seconds", "stream_rl_staleness_versions"})
CONTRACT_LABELS = frozenset({"role", "instance_id", "topic", "partition", "group", "stage", "name"})
DASHBOARD_TRAINER_METRICS = {"reward/mean", "kl/ref_mean", "policy/entropy", "loss/total", "policy/clipfrac"}


def _subst(text: str) -> str:
    """Compose variable substitution with every variable unset: ``${X:-default}`` -> default."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "ops" / "otel-collector.yaml").read_text())


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "ops" / "prometheus.yml").read_text())


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _role_services(services) -> dict[str, str]:
    """{service: role command} for the long-running roles."""
    return {name: svc["command"][0] for name, svc in services.items()
            if svc.get("command") and svc["command"][0] in ROLE_COMMANDS}


def _image_service(services, repository: str) -> str:
    found = [n for n, s in services.items() if s.get("image", "").split(":")[0] == repository]
    assert len(found) == 1, f"exactly one service should run {repository}, got {found}"
    return found[0]


def _container_ports(svc: dict[str, Any]) -> set[int]:
    """Ports a service offers on the compose network: expose + the container side of ports."""
    ports = {int(str(p)) for p in svc.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in svc.get("ports", [])}
    return ports


def _host_port(url: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"tcp://{url}")
    assert parsed.hostname and parsed.port, f"{url!r} names no host:port"
    return parsed.hostname, parsed.port


def _stream_rl_env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment") or {}
    return {k: _subst(str(v)) for k, v in env.items() if k.startswith("STREAM_RL_")}


def _env_file_vars(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of an env file, including commented-out examples (``# KEY=value``)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^#?\s*(STREAM_RL_[A-Z0-9_]+)=(.*)$", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _field(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _mount_source(svc: dict[str, Any], target: str) -> str:
    for vol in svc.get("volumes", []):
        parts = _subst(vol).split(":")
        if parts[1] == target:
            return parts[0]
    raise AssertionError(f"no volume mounted at {target}")


def _config_for(svc: dict[str, Any]) -> tuple[StreamRLConfig, dict[str, str]]:
    """Load the config a role container sees: its mounted config file + its STREAM_RL_* environment."""
    env = _stream_rl_env(svc)
    file = ROOT / _mount_source(svc, env.pop("STREAM_RL_CONFIG"))
    return load_config(file, env=env), env


def test_every_deploy_file_parses():
    files = [COMPOSE, *sorted((ROOT / "ops").rglob("*.y*ml")), *sorted((ROOT / "ops").rglob("*.json"))]
    assert len(files) >= 6
    for path in files:
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        assert isinstance(data, dict) and data, path


def test_images_are_pinned(services):
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for name, svc in services.items():
        image = svc.get("image")
        assert image, f"service {name} has no image"
        repo, sep, tag = image.rpartition(":")
        assert sep and repo and tag and "/" not in tag, f"service {name}: image {image!r} has no tag"
        assert tag != "latest", f"service {name}: image {image!r} is not pinned"
        if "build" in svc:
            assert image == f"stream-rl:{version}", f"service {name} builds {image!r}, pyproject says {version}"
    for repo in ("apache/kafka", "otel/opentelemetry-collector-contrib", "jaegertracing/jaeger", "prom/prometheus",
                 "grafana/grafana"):
        _image_service(services, repo)


def test_kafka_is_kraft_with_volume_and_healthcheck(compose, services):
    kafka = services[_image_service(services, "apache/kafka")]
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "kafka-broker-api-versions.sh" in " ".join(kafka["healthcheck"]["test"])
    volume = kafka["volumes"][0].split(":")
    assert volume[0] in compose["volumes"] and volume[1] == env["KAFKA_LOG_DIRS"]
    advertised = _host_port(env["KAFKA_ADVERTISED_LISTENERS"].split(",")[0].split("://", 1)[1])
    for name, svc in services.items():
        bootstrap = _stream_rl_env(svc).get("STREAM_RL_KAFKA__BOOTSTRAP_SERVERS")
        if bootstrap is not None:
            assert _host_port(bootstrap) == advertised, name
            assert svc["depends_on"]["kafka"]["condition"] == "service_healthy", name


def test_roles_scale_and_are_health_checked(services):
    roles = _role_services(services)
    assert set(roles.values()) == set(ROLE_COMMANDS)
    assert sum(cmd == "train" for cmd in roles.values()) == 1
    for name, command in roles.items():
        svc = services[name]
        cfg, _ = _config_for(svc)
        assert "/healthz" in " ".join(svc["healthcheck"]["test"])
        assert f":{cfg.telemetry.http_port}/" in " ".join(svc["healthcheck"]["test"])
        assert cfg.telemetry.http_port in _container_ports(svc)
        if command != "train":  # `docker compose up --scale producer=3` needs these free
            assert "container_name" not in svc, name
            assert not svc.get("ports"), f"scalable service {name} publishes a host port"
        assert svc.get("restart") == "on-failure"
    assert services["trainer"]["command"] == ["train", "--resume"]


def test_every_stream_rl_variable_is_a_config_field(services):
    checked = 0
    for name, svc in services.items():
        env = _stream_rl_env(svc)
        if not env:
            continue
        cfg, env = _config_for(svc)  # extra="forbid": an unknown field or an invalid value raises here
        for var, raw in env.items():
            dotted = var[len("STREAM_RL_"):].lower().replace("__", ".")
            want = yaml.safe_load(raw)
            got = _field(cfg, dotted)
            assert (str(got) if isinstance(got, Path) else got) == want, f"{name}: {var}={raw!r} gave {got!r}"
            checked += 1
        assert cfg.telemetry.exporters == ["jsonl", "prometheus", "otlp"] and cfg.tracing.exporter == "otlp"
        assert cfg.telemetry.http_host == "0.0.0.0"
    assert checked >= 5 * 12  # topics, prompts, producer, scorer, trainer


def test_env_file_example_names_real_fields():
    example = ROOT / "ops" / "compose.env.example"
    env = _env_file_vars(example)
    assert "STREAM_RL_KAFKA__SASL_PASSWORD_FILE" in env
    cfg = load_config(None, env=env)
    assert str(cfg.kafka.sasl_password_file) == env["STREAM_RL_KAFKA__SASL_PASSWORD_FILE"]
    assert cfg.kafka.security_protocol == "SASL_SSL"
    live = [line for line in example.read_text().splitlines() if line and not line.startswith("#")]
    assert not any(re.search(r"PASSWORD|SECRET|TOKEN", line.split("=")[0]) for line in live)


def test_no_inline_secrets(services):
    for name, svc in services.items():
        for var, value in (svc.get("environment") or {}).items():
            if re.search(r"PASSWORD|SECRET|TOKEN|CREDENTIAL", var) and not var.endswith("_FILE"):
                raise AssertionError(f"service {name} sets {var} inline; use an env file or a docker secret")
        for entry in svc.get("env_file", []):
            path = entry["path"] if isinstance(entry, dict) else entry
            assert path.startswith("ops/") and path.endswith(".env"), path
            gitignore = (ROOT / ".gitignore").read_text().splitlines()
            assert path in gitignore, f"{path} (credentials) must be git-ignored"


def test_collector_routes_to_jaeger_and_prometheus(services, collector, prometheus):
    name = _image_service(services, "otel/opentelemetry-collector-contrib")
    offered = _container_ports(services[name])
    http = _host_port(collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"])[1]
    grpc = _host_port(collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])[1]
    assert {http, grpc} <= offered
    for svc_name, svc in _role_services(services).items():
        env = _stream_rl_env(services[svc_name])
        for var, path in (("STREAM_RL_TELEMETRY__OTLP_ENDPOINT", "/v1/metrics"),
                          ("STREAM_RL_TRACING__OTLP_ENDPOINT", "/v1/traces")):
            assert _host_port(env[var]) == (name, http), f"{svc_name}: {var}"
            assert urlparse(env[var]).path == path
    jaeger = _image_service(services, "jaegertracing/jaeger")
    exporters = collector["exporters"]
    assert _host_port(exporters["otlp/jaeger"]["endpoint"]) in {(jaeger, p) for p in
                                                               _container_ports(services[jaeger])}
    prom_port = _host_port(exporters["prometheus"]["endpoint"])[1]
    assert prom_port in offered
    pipelines = collector["service"]["pipelines"]
    assert pipelines["traces"]["exporters"] == ["otlp/jaeger"] and pipelines["metrics"]["exporters"] == ["prometheus"]
    for pipe in pipelines.values():
        assert set(pipe["receivers"]) <= set(collector["receivers"])
        assert set(pipe["processors"]) <= set(collector["processors"])
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == [f"{name}:{prom_port}"]


def test_prometheus_scrapes_every_role(services, prometheus):
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    (sd,) = jobs["stream-rl"]["dns_sd_configs"]
    roles = _role_services(services)
    assert set(sd["names"]) == set(roles)
    for name in roles:
        cfg, _ = _config_for(services[name])
        assert sd["port"] == cfg.telemetry.http_port and "prometheus" in cfg.telemetry.exporters
    assert jobs["stream-rl"]["metrics_path"] == "/metrics"


def test_grafana_provisioning_matches_services(services, dashboard):
    grafana = services[_image_service(services, "grafana/grafana")]
    prom = _image_service(services, "prom/prometheus")
    prov = ROOT / "ops" / "grafana" / "provisioning"
    (source,) = yaml.safe_load((prov / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert _host_port(source["url"]) in {(prom, p) for p in _container_ports(services[prom])}
    assert _mount_source(grafana, "/etc/grafana/provisioning") == "./ops/grafana/provisioning"
    (provider,) = yaml.safe_load((prov / "dashboards" / "stream-rl.yaml").read_text())["providers"]
    assert _mount_source(grafana, provider["options"]["path"]) == "./ops/grafana/dashboards"
    for svc in services.values():
        for vol in svc.get("volumes", []):
            src = _subst(vol).split(":")[0]
            if src.startswith("./") and "runs/" not in src:
                assert (ROOT / src).exists(), f"bind mount source {src} is missing"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"])


def _dashboard_exprs(dashboard) -> list[str]:
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def test_dashboard_uses_only_contract_metrics_and_labels(dashboard):
    used, labels, names = set(), set(), set()
    for expr in _dashboard_exprs(dashboard):
        for metric in re.findall(r"\bstream_rl_[a-z0-9_]+", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", metric)
            assert base in CONTRACT_METRICS, f"dashboard query uses {metric}, not in the metric contract"
            assert base == metric or base in CONTRACT_HISTOGRAMS, metric
            used.add(base)
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            labels |= {label.strip() for label in group.split(",")}
        labels |= set(re.findall(r"[{,]\s*([a-z_]+)=", expr)) - {"job"}
        names |= set(re.findall(r'name="([^"]+)"', expr))
    assert used == CONTRACT_METRICS, f"contract metrics without a panel: {sorted(CONTRACT_METRICS - used)}"
    assert labels <= CONTRACT_LABELS | {"le"}, labels - CONTRACT_LABELS
    assert names == DASHBOARD_TRAINER_METRICS
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("reward", "kl", "entropy", "loss", "clip", "per role", "lag", "staleness", "rss", "gpu",
                  "dead letters", "alerts"):
        assert topic in titles, topic


def test_contract_metrics_are_exported():
    source = "\n".join(p.read_text() for p in (ROOT / "stream_rl" / "telemetry").glob("*.py"))
    exported = set(re.findall(r'"(stream_rl_[a-z0-9_]+)"', source))
    assert CONTRACT_METRICS <= exported, sorted(CONTRACT_METRICS - exported)
    trainer_source = "\n".join(p.read_text() for p in (ROOT / "consumers" / "trainer").glob("*.py"))
    trainer_source += "\n".join(p.read_text() for p in (ROOT / "stream_rl" / "algorithms").glob("*.py"))
    for name in DASHBOARD_TRAINER_METRICS:  # a literal "policy/entropy", or f"policy/{k}" over a "clipfrac" key
        section, _, key = name.partition("/")
        found = f'"{name}"' in trainer_source or (f'f"{section}/{{' in trainer_source and f'"{key}"' in trainer_source)
        assert found, f"the trainer reports no metric {name}"


def test_dockerfile_runs_stream_rl():
    text = (ROOT / "ops" / "Dockerfile").read_text()
    entry = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    assert entry and json.loads(entry.group(1)) == ["stream-rl"]
    assert 'stream-rl = "stream_rl.cli.main:main"' in (ROOT / "pyproject.toml").read_text()
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+\s*$", text, re.M):
        for item in src.split():
            assert (ROOT / item).exists(), f"Dockerfile copies {item}, which is missing"
    assert re.match(r"^FROM \S+:\d", text.split("\n", 2)[1] if text.startswith("#") else text)


def test_runbook_names_real_alerts_and_knobs():
    from stream_rl.alerts.config import AlertsConfig
    from stream_rl.config.base import sections_of

    text = (ROOT / "docs" / "operations.md").read_text()
    rules = {name for name, f in AlertsConfig.model_fields.items() if hasattr(f.annotation, "model_fields")}
    for rule in rules:
        assert f"`{rule}`" in text, f"runbook does not mention alert {rule}"
    roots = set(StreamRLConfig.model_fields)
    knobs = {k for k in re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)+)`", text) if k.split(".")[0] in roots}
    assert len(knobs) >= 20
    for knob in knobs:
        model: Any = StreamRLConfig
        for part in knob.split("."):
            assert hasattr(model, "model_fields") and part in model.model_fields, f"runbook names {knob}"
            annotation = model.model_fields[part].annotation
            model = next(iter(sections_of(annotation)), annotation)  # an optional section (X | None) is X
