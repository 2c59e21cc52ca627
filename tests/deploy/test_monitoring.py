"""deploy/monitoring: the alert rules and the Grafana dashboard name only metrics the code exports,
are well formed (a schema check always; ``promtool`` where it is installed), and the alerts fire on
the series that should fire them, and only on those."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.tools import DEPLOY, ROOT, system_tool
from tierstore._platform.save_metrics import SAMPLE_NAMES
from tierstore.dcp.tools.drill import DrillReport
from tierstore.promote.health import PromoterHealth
from tierstore.promote.metrics import PromoterMetrics

MONITORING = DEPLOY / "monitoring"
RULES = MONITORING / "tierstore-alerts.yaml"
DASHBOARD = MONITORING / "tierstore-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"
PROMETHEUS_OWN = {"up"}
"""Series Prometheus itself makes for every target."""
SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def drill_names() -> set[str]:
    """Every series name ``tierstore drill --prom-file`` writes (a report with every value set)."""
    report = DrillReport(
        "step_1",
        "s3",
        1,
        True,
        "ok",
        0.01,
        max_relative_error=0.0,
        restore_s=1.0,
        rto_s=2.0,
        bytes_read={"s3": 1},
    )
    return {line.split("{", 1)[0] for line in report.prometheus()}


def exported() -> set[str]:
    """Every series name the promoter's /metrics can carry (its own registry, its health, the
    trainer ranks' files), and the restore drill's (pushed to a Pushgateway, or a textfile)."""
    metrics = PromoterMetrics()
    metrics.watch(PromoterHealth(300.0), None)
    names = set(SAMPLE_NAMES) | drill_names()
    for metric in metrics.registry.collect():
        names |= {metric.name + suffix for suffix in SUFFIXES[metric.type]}
    return names


# -- PromQL: the metric names an expression reads ---------------------------------------------------

KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (inside ``{...}`` or a ``by (...)`` clause) or durations (inside ``[...]``)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = _CLAUSE.sub(" ", text)
    found = set()
    for match in _IDENT.finditer(text):
        name, call = match.groups()
        if call is None and name.lower() not in KEYWORDS:
            found.add(name)
    return found


def balanced(expr: str) -> bool:
    """Brackets of every kind open and close in order (strings aside)."""
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for char in _STRING.sub('""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def test_metric_names_are_read_out_of_promql() -> None:
    expr = (
        'sum by (le, tier) (rate(a_bucket{instance=~"$instance", x="b c"}[5m])) / ignoring (x)'
        " b_total offset 1h > bool 3 unless on (job) (time() - c)"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c"}
    assert balanced(expr) and not balanced("sum(rate(a[5m])")


# -- the alert rules -------------------------------------------------------------------------------


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    assert set(document) == {"groups"}
    found = []
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["name"]
        found += group["rules"]
    return found


TEMPLATE = re.compile(r"\s*\$(value|labels\.\w+)(\s*\|\s*(humanize|humanizeDuration))?\s*")
DURATION = re.compile(r"^(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?$")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    found = set()
    for line in markdown.splitlines():
        if match := re.match(r"#+\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


def test_every_alert_is_well_formed_with_a_runbook() -> None:
    found = rules()
    names = [r["alert"] for r in found]
    assert len(names) == len(set(names))
    documented = anchors(OPERATIONS.read_text())
    for rule in found:
        name = rule["alert"]
        assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
        assert re.fullmatch(r"Tierstore[A-Z][A-Za-z]+", name)
        assert isinstance(rule["expr"], str) and rule["expr"].strip(), name
        assert balanced(rule["expr"]), name
        assert DURATION.fullmatch(rule.get("for", "0s")) and rule.get("for") != "", name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(annotations), name
        for text in (annotations["summary"], annotations["description"]):
            templates = re.findall(r"\{\{(.*?)\}\}", text)
            assert text.count("{{") == text.count("}}") == len(templates), name
            assert all(TEMPLATE.fullmatch(t) for t in templates), (name, templates)
        page, anchor = annotations["runbook_url"].split("#")
        assert page == "docs/operations.md" and anchor == name.lower(), name
        assert anchor in documented, f"{name}: no section {anchor!r} in docs/operations.md"


def test_the_required_alerts_are_there() -> None:
    reads = {r["alert"]: metric_names(r["expr"]) for r in rules()}
    assert "tierstore_recovery_point_lag_seconds" in reads["TierstoreRecoveryPointLagHigh"]
    assert "tierstore_tier_unavailable" in reads["TierstoreTierUnavailable"]
    assert "tierstore_promoter_live" in reads["TierstorePromoterStuck"]
    assert "up" in reads["TierstorePromoterDown"]
    assert "tierstore_promoter_failed_passes_total" in reads["TierstorePromoterPassesFailing"]
    assert "tierstore_promotion_failures_total" in reads["TierstorePromotionsFailing"]
    assert "tierstore_mirror_redundant" in reads["TierstoreMirrorRedundancyLost"]
    assert "tierstore_saves_failed_total" in reads["TierstoreSavesFailing"]
    # The drill's verdict reaches an alert: a failed drill, and drills that stopped running (a
    # CronJob whose pod stays Pending, a broken scrontab line).
    assert "tierstore_drill_success" in reads["TierstoreRestoreDrillFailed"]
    assert "tierstore_drill_last_run_timestamp_seconds" in reads["TierstoreRestoreDrillStale"]


def test_the_rules_and_the_dashboard_name_only_exported_metrics() -> None:
    known = exported() | PROMETHEUS_OWN
    used = {f"alert {r['alert']}": metric_names(r["expr"]) for r in rules()}
    for panel, expr in dashboard_exprs():
        used.setdefault(f"panel {panel!r}", set()).update(metric_names(expr))
    for variable in dashboard()["templating"]["list"]:  # label_values(METRIC, label)
        if variable["type"] == "query":
            query = re.fullmatch(r"label_values\((\w+)(?:\{[^}]*\})?, *\w+\)", variable["query"]["query"])
            assert query, variable["query"]
            used[f"variable {variable['name']}"] = {query.group(1)}
    unknown = {where: sorted(names - known) for where, names in used.items() if names - known}
    assert unknown == {}, "rename in deploy/monitoring too (or export the metric)"
    assert len(set().union(*used.values())) > 20  # the parser found them at all


def test_promtool_accepts_the_rules() -> None:
    promtool = system_tool("promtool", "the rules' PromQL and templates")
    done = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_shipped_scrape_configuration() -> None:
    """deploy/monitoring/prometheus.yml scrapes the promoters and loads the rules beside it."""
    promtool = system_tool("promtool", "the scrape configuration")
    shipped = DEPLOY / "monitoring" / "prometheus.yml"
    done = subprocess.run(
        [promtool, "check", "config", str(shipped)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load(shipped.read_text())
    assert config["rule_files"] == [RULES.name]
    targets = json.loads((shipped.parent / "tierstore-nodes.json").read_text())
    assert all(t.endswith(":9400") for group in targets for t in group["targets"])


UNIT_TESTS = """
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: tierstore_recovery_point_lag_seconds{instance="n0:9400",job="ts"}
        values: 3000+60x40
      - series: tierstore_recovery_point_lag_seconds{instance="n1:9400",job="ts"}
        values: 9000+60x40
      - series: tierstore_tier_unavailable{instance="n0:9400",job="ts",tier="s3"}
        values: 0 0 1x30
      - series: tierstore_tier_unavailable{instance="n0:9400",job="ts",tier="nvme"}
        values: 0x30
      - series: up{instance="n0:9400",job="ts"}
        values: 1x40
      - series: up{instance="n1:9400",job="ts"}
        values: 1x10 0x30
      - series: up{instance="other:80",job="other"}
        values: 0x40
      - series: tierstore_promoter_live{instance="n0:9400",job="ts"}
        values: 1x5 0x35
      - series: tierstore_promoter_live{instance="n1:9400",job="ts"}
        values: 1x10
      - series: tierstore_mirror_redundant{instance="n0:9400",job="ts",tier="ram"}
        values: 1x5 0x35
      - series: tierstore_mirror_redundant{instance="n1:9400",job="ts",tier="ram"}
        values: 1x40
    alert_rule_test:
      - eval_time: 15m
        alertname: TierstoreRecoveryPointLagHigh
      - eval_time: 25m
        alertname: TierstoreRecoveryPointLagHigh
        exp_alerts:
          - exp_labels: {severity: warning, job: ts}
      - eval_time: 10m
        alertname: TierstoreTierUnavailable
      - eval_time: 15m
        alertname: TierstoreTierUnavailable
        exp_alerts:
          - exp_labels: {severity: warning, instance: "n0:9400", job: ts, tier: s3}
      - eval_time: 20m
        alertname: TierstorePromoterDown
        exp_alerts:
          - exp_labels: {severity: critical, instance: "n1:9400", job: ts}
      - eval_time: 20m
        alertname: TierstorePromoterStuck
        exp_alerts:
          - exp_labels: {severity: critical, instance: "n0:9400", job: ts}
      - eval_time: 15m
        alertname: TierstoreMirrorRedundancyLost
      - eval_time: 25m
        alertname: TierstoreMirrorRedundancyLost
        exp_alerts:
          - exp_labels: {severity: warning, instance: "n0:9400", job: ts, tier: ram}
  - interval: 1m
    input_series:
      - series: tierstore_promoter_failed_passes_total{instance="n0:9400",job="ts"}
        values: 0+1x60
      - series: tierstore_promoter_passes_total{instance="n0:9400",job="ts"}
        values: 7x60
      - series: tierstore_promoter_failed_passes_total{instance="n1:9400",job="ts"}
        values: 0+1x60
      - series: tierstore_promoter_passes_total{instance="n1:9400",job="ts"}
        values: 0+1x60
      - series: tierstore_promotion_failures_total{instance="n0:9400",job="ts",tier="s3"}
        values: 0+1x60
      - series: tierstore_promoted_checkpoints_total{instance="n0:9400",job="ts",tier="s3"}
        values: 3x60
      - series: tierstore_promotion_failures_total{instance="n0:9400",job="ts",tier="nvme"}
        values: 0+1x60
      - series: tierstore_promoted_checkpoints_total{instance="n0:9400",job="ts",tier="nvme"}
        values: 0+1x60
      - series: tierstore_saves_failed_total{instance="n0:9400",job="ts",rank="0",tier="ram"}
        values: 0 0 1x60
      - series: tierstore_saves_failed_total{instance="n0:9400",job="ts",rank="1",tier="ram"}
        values: 0x60
      - series: tierstore_conflicts{instance="n0:9400",job="ts",tier="s3"}
        values: 2x90
    alert_rule_test:
      - eval_time: 30m
        alertname: TierstorePromoterPassesFailing
        exp_alerts:
          - exp_labels: {severity: warning, instance: "n0:9400", job: ts}
      - eval_time: 45m
        alertname: TierstorePromotionsFailing
        exp_alerts:
          - exp_labels: {severity: warning, instance: "n0:9400", job: ts, tier: s3}
      - eval_time: 5m
        alertname: TierstoreSavesFailing
        exp_alerts:
          - exp_labels: {severity: warning, instance: "n0:9400", job: ts, tier: ram}
      - eval_time: 45m
        alertname: TierstoreSavesFailing
      - eval_time: 70m
        alertname: TierstoreConflicts
        exp_alerts:
          - exp_labels: {severity: info, instance: "n0:9400", job: ts, tier: s3}
  # The drill's metrics as a Pushgateway serves them (one group per namespace, replaced by each
  # push): ns a's daily drill passes, then fails; ns b's last drill ran at 0 and none since.
  - interval: 1m
    input_series:
      - series: tierstore_drill_success{namespace="a",tier="s3",checkpoint_id="c2",world_size="1"}
        values: 1x2879 0x720
      - series: 'tierstore_drill_last_run_timestamp_seconds{namespace="a",tier="s3",
          checkpoint_id="c2",world_size="1"}'
        values: 0+60x3600
      - series: tierstore_drill_success{namespace="b",tier="s3",checkpoint_id="c1",world_size="1"}
        values: 1x3600
      - series: 'tierstore_drill_last_run_timestamp_seconds{namespace="b",tier="s3",
          checkpoint_id="c1",world_size="1"}'
        values: 0x3600
    alert_rule_test:
      - eval_time: 47h
        alertname: TierstoreRestoreDrillFailed
      - eval_time: 48h
        alertname: TierstoreRestoreDrillFailed
        exp_alerts:
          - exp_labels: {severity: critical, namespace: a, tier: s3, checkpoint_id: c2,
                        world_size: "1"}
      - eval_time: 48h
        alertname: TierstoreRestoreDrillStale
      - eval_time: 50h
        alertname: TierstoreRestoreDrillStale
        exp_alerts:
          - exp_labels: {severity: warning, namespace: b, tier: s3}
"""


def test_the_alerts_fire_on_their_series_and_only_on_them(tmp_path: Path) -> None:
    """``promtool test rules`` on the shipped rules. Annotations are left out of the copy tested
    (promtool compares them whole; ``check rules`` parses their templates)."""
    promtool = system_tool("promtool", "the alerts' behaviour")
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(document))
    # Written as is: a YAML 1.1 load and dump would turn `values: 0x30` ("0, 30 times") into 48.
    cases = yaml.safe_load(UNIT_TESTS)
    tested = {t["alertname"] for case in cases["tests"] for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in rules()}  # every alert is exercised
    (tmp_path / "cases.yaml").write_text(UNIT_TESTS)
    done = subprocess.run(
        [promtool, "test", "rules", "cases.yaml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def promtool_parses(tmp_path: Path, exprs: dict[str, str]) -> str:
    """``promtool check rules`` on one recording rule per expression: its output, empty when it
    parses every one (Grafana's variables stand in as a regex and a range)."""
    promtool = system_tool("promtool", "the dashboard's PromQL")
    grafana = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$instance": ".*"}
    recorded = []
    for name, expr in exprs.items():
        query = expr
        for variable, value in grafana.items():
            query = query.replace(variable, value)
        recorded.append({"record": name, "expr": query})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": recorded}]}))
    done = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    exprs = {f"panel:{i}": expr for i, (_title, expr) in enumerate(dashboard_exprs())}
    assert len(exprs) > 20
    assert promtool_parses(tmp_path, exprs) == ""
    # The check can fail: a query Prometheus would refuse is reported.
    assert "parse error" in promtool_parses(tmp_path, {"broken:0": "sum by (tier (x)"})


# -- the dashboard ---------------------------------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def dashboard_exprs() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    board = dashboard()
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", board["uid"])
    assert board["title"] and isinstance(board["schemaVersion"], int) and board["id"] is None
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        cells = {(grid["y"] + dy, grid["x"] + dx) for dy in range(grid["h"]) for dx in range(grid["w"])}
        assert not cells & occupied, f"{panel['title']!r} overlaps another panel"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat"} and panel["description"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert balanced(target["expr"]), target["expr"]
            assert 'job="$job", instance=~"$instance"' in target["expr"], target["expr"]
    # One job at a time: a stat over every job would let one run hide another's lag.
    assert variables["job"]["multi"] is False and variables["job"]["includeAll"] is False
    assert '{job="$job"}' in variables["instance"]["query"]["query"]


def test_the_dashboard_shows_what_an_operator_asks_first() -> None:
    shown = set().union(*(metric_names(expr) for _title, expr in dashboard_exprs()))
    for name in (
        "tierstore_recovery_point_lag_seconds",
        "tierstore_newest_checkpoint_age_seconds",
        "tierstore_save_last_stall_seconds",
        "tierstore_save_last_commit_seconds",
        "tierstore_save_written_bytes_total",
        "tierstore_promoted_checkpoints_total",
        "tierstore_promotion_failures_total",
        "tierstore_tier_unavailable",
        "tierstore_mirror_redundant",
        "tierstore_promoter_live",
    ):
        assert name in shown, name


@pytest.mark.parametrize("path", [RULES, DASHBOARD])
def test_the_monitoring_files_are_listed_in_the_deploy_readme(path: Path) -> None:
    assert path.relative_to(DEPLOY).as_posix() in (DEPLOY / "README.md").read_text()
