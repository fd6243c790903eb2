"""The whole flow on the embedded pair (tiny profile) through real services, in a copy of the project:
`semspec services up` -> `semspec run`, then `prefect deployment run semspec/full --watch` -> the MLflow UI's REST
API -> a new pair picked up by `semspec/retrain` -> `semspec services down`, which must leave nothing."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from semspec.models.project.names import STAGES
from tests.helpers.project import copy_project, free_port, project_environ

pytestmark = [pytest.mark.embedded, pytest.mark.services, pytest.mark.timeout(2400)]
CHAMPION = {"name": "semspec-embedded-target-all", "alias": "champion"}
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"  # screenshots, kept after the run
FAKE_TOKEN = "hf_semspecFakeToken0123456789abcdef"


class Project:
    """A project copy with its own services; commands run in it."""

    def __init__(self, root: Path, data_dir: Path):
        self.root = root
        self.env = project_environ(root, free_port(), free_port())
        self.env["SEMSPEC_DATA_DIR"] = str(data_dir)
        self.env["HF_TOKEN"] = FAKE_TOKEN  # a user's Hub token: it must never reach a log or a store
        self.api = self.env["PREFECT_API_URL"]
        self.mlflow = f"http://127.0.0.1:{self.env['SEMSPEC_MLFLOW_PORT']}"

    def run(self, *argv: str, timeout: float = 1500) -> subprocess.CompletedProcess:
        res = subprocess.run(
            argv, cwd=self.root, env=self.env, text=True, capture_output=True, timeout=timeout
        )
        assert res.returncode == 0, (
            f"{' '.join(argv)} failed ({res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        )
        return res

    def artifact(self, key: str) -> str:
        token = httpx.get(f"{self.api}/csrf-token", params={"client": "tests"}).json()["token"]
        r = httpx.post(
            f"{self.api}/artifacts/filter",
            json={"artifacts": {"key": {"any_": [key]}}, "sort": "CREATED_DESC"},
            headers={"Prefect-Csrf-Token": token, "Prefect-Csrf-Client": "tests"},
        )
        r.raise_for_status()
        return r.json()[0]["data"]

    def mlflow_post(self, path: str, body: dict) -> dict:
        r = httpx.post(f"{self.mlflow}/api/2.0/mlflow/{path}", json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def mlflow_get(self, path: str, params: dict) -> dict:
        r = httpx.get(f"{self.mlflow}/api/2.0/mlflow/{path}", params=params, timeout=30)
        r.raise_for_status()
        return r.json()

    def pids(self) -> list[int]:
        return [json.loads(p.read_text())["pid"] for p in (self.root / ".services").glob("*.json")]


@pytest.fixture(scope="module")
def project(tmp_path_factory, data_dir):
    proj = Project(copy_project(tmp_path_factory.mktemp("project"), profile="tiny"), data_dir)
    try:
        up = proj.run("semspec", "services", "up", timeout=400)
        assert "prefect: ready" in up.stdout and "mlflow: ready" in up.stdout and "serve: ready" in up.stdout
        yield proj
    finally:
        pids = proj.pids()
        subprocess.run(["semspec", "services", "down"], cwd=proj.root, env=proj.env, timeout=120)
        assert not any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
        )


def test_services_up_is_idempotent_and_both_deployments_exist(project):
    before = sorted(project.pids())
    again = project.run("semspec", "services", "up")
    assert again.stdout.count("already running") == 3 and sorted(project.pids()) == before
    status = project.run("semspec", "services", "status")
    assert status.stdout.count(" running ") == 3 and status.stdout.count("ready") == 3
    listed = project.run("prefect", "deployment", "ls").stdout
    assert "semspec/full" in listed and "semspec/retrain" in listed
    retrain = httpx.get(f"{project.api}/deployments/name/semspec/retrain").json()
    assert retrain["schedules"][0]["schedule"]["cron"] == "0 3 * * 1" and retrain["parameters"] == {
        "retrain": True
    }


def test_every_service_listens_on_loopback_only(project):
    listening = []
    for pid in project.pids():
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            listening += [c.laddr for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening, "the services listen somewhere"
    assert {addr.ip for addr in listening} <= {"127.0.0.1", "::1"}, listening


def test_a_foreign_web_page_cannot_drive_either_api(project):
    foreign = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    # Prefect: a preflight from another origin is refused, the UI's own origin allowed; a POST without a
    # CSRF token (a form a web page could send without preflight) is refused
    url = f"{project.api}/deployments/filter"
    r = httpx.options(url, headers=foreign)
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    own = project.api.removesuffix("/api")
    r = httpx.options(url, headers={**foreign, "Origin": own})
    assert r.headers.get("access-control-allow-origin") == own
    assert httpx.post(url, json={}).status_code == 403
    # MLflow: a foreign Host header (DNS rebinding) and a foreign preflight are refused
    api = f"{project.mlflow}/api/2.0/mlflow/experiments/search"
    assert httpx.get(api, params={"max_results": 1}, headers={"Host": "evil.example"}).status_code >= 400
    r = httpx.options(api, headers=foreign)
    assert r.headers.get("access-control-allow-origin") in (None, "")


def _stage_process(stage: str) -> psutil.Process | None:
    """The running `semspec <stage>` command (the stage the flow is in), if any."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if stage in cmd[:3] and any(c.endswith("/semspec") for c in cmd[:2]):
            return p
    return None


def _pid(project: Project, service: str) -> int:
    return json.loads((project.root / f".services/{service}.json").read_text())["pid"]


def test_full_deployment_survives_a_killed_prefect_server_and_records_it_in_dvc(project):
    """The README's way (`semspec run`: the flow run followed in the terminal), with the Prefect server
    SIGKILLed while the flow runs `train`: the terminal says the API was lost; the flow run goes on without
    its server (Prefect 3 runs tasks client-side) and DVC records each stage it finishes; `semspec services
    up` starts the server again over its stale PID record; the next run redoes nothing DVC recorded and
    runs whatever is left."""
    follow = subprocess.Popen(
        ["semspec", "run"],
        cwd=project.root,
        env=project.env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 1500
    while _stage_process("train") is None and follow.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert follow.poll() is None, "the flow must still be running `train`"
    flow_run = psutil.Process(_pid(project, "serve")).children(recursive=True)  # the flow run and its stage
    server = psutil.Process(_pid(project, "prefect"))
    for p in [server, *server.children(recursive=True)]:
        p.kill()
    lost, _ = follow.communicate(timeout=600)
    assert follow.returncode != 0 and "semspec services up" in lost, lost[-3000:]
    _, alive = psutil.wait_procs(flow_run, timeout=900)  # the lost run ends (done, or given up)
    assert not alive, "the lost flow run must end by itself"
    changed = json.loads(project.run("dvc", "status", "--json").stdout or "{}")
    assert not {"ingest", "sample", "cross", "cluster", "train"} & set(changed), (
        "stages the lost run finished"
    )
    status = subprocess.run(
        ["semspec", "services", "status"], cwd=project.root, env=project.env, text=True, capture_output=True
    )
    assert re.search(r"^prefect\s+dead", status.stdout, re.M), status.stdout
    up = project.run("semspec", "services", "up", timeout=400).stdout
    assert "prefect: ready" in up and "mlflow: already running" in up, up

    out = project.run("semspec", "run").stdout
    assert "\x1b[" not in lost + out, "no raw ANSI codes in the terminal"
    # each stage's progress (done/total, rate, ETA) streams as it runs
    for stage in ("sample", *(["evaluate"] if "evaluate" in changed else [])):
        text = lost if stage == "sample" else out
        assert re.search(rf"{stage}: +\d+%\|.*\| \d+/\d+ \[", text), (
            f"no {stage} progress in:\n{text[-3000:]}"
        )
    assert f"{project.api.removesuffix('/api')}/runs/flow-run/" in out
    assert f"Compare the probes (MLflow): {project.mlflow}/#/compare-runs?runs=" in out
    report = project.artifact("semspec-embedded")
    assert "## Compare the probe variants" in report
    for stage in STAGES:
        assert f"| {stage} | dvc | {'ran' if stage in changed else 'up to date'} |" in report, report
    assert "## Decode smoke test (registered champion probes)" in report and "probe-target-all" in report
    assert "Data and pipelines are up to date" in project.run("dvc", "status").stdout
    assert (project.root / "dvc.lock").is_file()


@pytest.mark.browser
def test_the_printed_compare_link_shows_the_probe_variants_in_a_browser(project):
    """Open the link `semspec report` prints in headless Chromium: the MLflow UI compares the four probe
    variants of both roles with their test metrics. The screenshot is kept in test-artifacts/."""
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver_bin, "install Debian's chromium and chromium-driver (.ci/run does)"
    printed = project.run("semspec", "report").stdout
    link = re.search(r"Compare the probes \(MLflow\): (\S+)", printed)
    assert link, "the report prints the compare link"
    experiment = re.search(r"MLflow UI: +(\S+#/experiments/\S+)", printed)
    assert experiment, "the report links the pair's experiment"
    opts = Options()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1300"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        browser.get(link.group(1))
        WebDriverWait(browser, 120).until(lambda b: "probe-target-all" in b.page_source)
        WebDriverWait(browser, 60).until(lambda b: "test_mse" in b.page_source)
        html = browser.page_source
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "mlflow-compare-probes.png"))
        # the experiment link opens on the runs (grouped under their stage's parent run), not on MLflow
        # 3's GenAI overview of traces
        browser.get(experiment.group(1))
        WebDriverWait(browser, 120).until(lambda b: "train-embedded" in b.page_source)
        runs_page = browser.page_source
        browser.save_screenshot(str(ARTIFACTS / "mlflow-experiment-runs.png"))
    finally:
        browser.quit()
    assert "evaluate-embedded" in runs_page and "Detect Issues" not in runs_page
    for role in ("draft", "target"):
        for variant in ("last", "all", "mix", "random"):
            assert f"probe-{role}-{variant}" in html
    assert "test_n" in html and "eval-" not in html, "probes only, with their test metrics"


def test_mlflow_ui_lists_probe_and_evaluation_runs_with_metrics(project):
    exp = project.mlflow_post(
        "experiments/search", {"max_results": 10, "filter": "name = 'semspec-embedded'"}
    )
    (exp_id,) = [e["experiment_id"] for e in exp["experiments"]]
    runs = project.mlflow_post("runs/search", {"experiment_ids": [exp_id], "max_results": 100})["runs"]
    by_name = {r["info"]["run_name"]: r for r in runs}
    probes = {f"probe-{r}-{v}" for r in ("draft", "target") for v in ("last", "all", "mix", "random")}
    evals = {"eval-target", "eval-draft", "eval-semanticspec-random", "eval-semanticspec-all"}
    assert probes | evals <= set(by_name)
    metrics = {
        name: {m["key"]: m["value"] for m in r["data"].get("metrics", [])} for name, r in by_name.items()
    }
    tags = {name: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for name, r in by_name.items()}
    for name in probes:
        # a tiny run's held-out question can have no valid sample: then only the count is logged
        assert "test_n" in metrics[name]
        if metrics[name]["test_n"] > 0:
            assert {"test_mse", "test_mae"} <= set(metrics[name])
        assert tags[name]["stage"] == "train" and tags[name]["config_hash"]
    assert any(metrics[f"probe-target-{v}"]["test_n"] > 0 for v in ("last", "all", "mix", "random"))
    for name in evals:
        assert {"arith_pass_at_1", "arith_tps", "arith_latency_s", "arith_target_share"} <= set(metrics[name])
        assert tags[name]["stage"] == "evaluate"
    found = project.mlflow_get(
        "registered-models/search", {"filter": "name LIKE 'semspec-embedded-%'", "max_results": 100}
    )
    registered = {m["name"] for m in found["registered_models"]}
    assert {f"semspec-embedded-{name[len('probe-') :]}" for name in probes} <= registered


def test_second_run_skips_every_stage(project):
    project.run("prefect", "deployment", "run", "semspec/full", "--watch")
    report = project.artifact("semspec-embedded")
    for stage in STAGES:
        assert f"| {stage} | dvc | up to date |" in report


def test_retrain_trains_a_new_pair_and_only_it(project):
    pair_data = yaml.safe_load((project.root / "conf/pairs/embedded.yaml").read_text())
    (project.root / "conf/pairs/embedded-copy.yaml").write_text(
        yaml.safe_dump({**pair_data, "name": "embedded-copy"})
    )
    before = project.run("semspec", "pairs", "status").stdout
    assert "embedded: up to date" in before and "embedded-copy: no champion probe" in before
    old = project.mlflow_get("registered-models/alias", CHAMPION)["model_version"]["version"]
    project.run("prefect", "deployment", "run", "semspec/retrain", "--watch")
    after = project.run("semspec", "pairs", "status").stdout
    assert "embedded: up to date" in after and "embedded-copy: up to date" in after
    assert "| train | direct | ran |" in project.artifact("semspec-embedded-copy")
    now = project.mlflow_get("registered-models/alias", CHAMPION)["model_version"]["version"]
    assert now == old  # the up-to-date pair was left alone


def test_the_hub_token_reaches_no_log_and_no_store(project):
    """After every run above: the HF_TOKEN the services and stages ran with is in no MLflow store or
    artifact, no Prefect database or log, no service log and no stage output."""
    places = ["mlruns.db", "mlartifacts", ".prefect", ".services", "reports", "eval", "data", "dvc.lock"]
    files = [
        f
        for p in places
        for f in ([project.root / p] if (project.root / p).is_file() else (project.root / p).rglob("*"))
        if f.is_file()
    ]
    assert any(f.name == "mlruns.db" for f in files) and any(f.suffix == ".log" for f in files)
    leaked = [str(f) for f in files if FAKE_TOKEN.encode() in f.read_bytes()]
    assert not leaked, f"the Hub token was written to {leaked}"
