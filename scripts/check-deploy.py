#!/usr/bin/env python3
"""Check the deployment files in deploy/: they parse, and they hold what a
cluster of ragkv replicas needs (the drain, the probes, the shared secret,
the memory, Redis without persistence, the model mounted read-only).

Exit status 0 when every check passes, 1 with a list of failures, 77 when
PyYAML (Debian: python3-yaml) is missing. tests/test_cluster.c runs it.

--sync first copies deploy/haproxy/haproxy.cfg into the ConfigMap of
deploy/k8s/haproxy.yaml (run it after editing the configuration)."""
import os
import re
import sys

try:
    import yaml
except ImportError:
    print("python3 yaml is not installed (Debian: python3-yaml, scripts/install-deps.sh)")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
    return ok


def load_all(rel):
    with open(os.path.join(DEPLOY, rel)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def mib(size):
    """'4Gi', '4g', '2gb', '2304Mi' in MiB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?)[bB]?", str(size).strip())
    if not m:
        raise ValueError(f"size {size!r}")
    scale = {"": 1 / (1 << 20), "k": 1 / 1024, "m": 1, "g": 1024}[m.group(2).lower()]
    return float(m.group(1)) * scale


def flag(args, name):
    """The value after --name in an argument list, or None."""
    args = [str(a) for a in args]
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def seconds(v):
    m = re.fullmatch(r"(\d+)(s|m)?", str(v))
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def check_redis_args(args, where):
    args = [str(a) for a in args]
    check(flag(args, "--save") == "", f"{where}: Redis keeps snapshots (want --save \"\")")
    check(flag(args, "--appendonly") == "no", f"{where}: Redis appendonly is not off")
    check(flag(args, "--maxmemory") is not None, f"{where}: Redis has no --maxmemory cap")
    check(flag(args, "--maxmemory-policy") == "allkeys-lru",
          f"{where}: Redis evicts by no allkeys-lru policy")
    return mib(flag(args, "--maxmemory") or 0)


def check_serve_args(args, where):
    args = [str(a) for a in args]
    check(args[:1] == ["serve"], f"{where}: the command is not `serve`")
    check(flag(args, "--kv-memory-mb") == "auto", f"{where}: --kv-memory-mb is not auto")
    check(flag(args, "--host") == "0.0.0.0", f"{where}: the server does not listen on 0.0.0.0")
    check((flag(args, "--redis") or "").startswith("redis://"), f"{where}: no --redis URL")
    check(flag(args, "--redis-secret-file") is not None, f"{where}: no --redis-secret-file")
    check((flag(args, "--model") or "").startswith("/models/"),
          f"{where}: the model is not read from the /models mount")
    grace = flag(args, "--grace-s")
    check(grace is not None, f"{where}: no --grace-s")
    return float(grace or 0)


def compose():
    (c,) = load_all("docker-compose.yml")
    s = c.get("services", {})
    if not all([check(n in s, f"compose: no service {n}") for n in ("ragkv", "redis", "haproxy")]):
        return
    r = s["ragkv"]
    grace = check_serve_args(r.get("command", []), "compose ragkv")
    check(r.get("deploy", {}).get("replicas", 1) >= 2, "compose: fewer than 2 replicas")
    check(seconds(r.get("stop_grace_period", "10s")) > grace + 10,
          "compose: stop_grace_period is not above --grace-s + request_timeout_s")
    check(r.get("stop_signal", "SIGTERM") == "SIGTERM", "compose: stop_signal is not SIGTERM")
    check("/ready" in " ".join(r.get("healthcheck", {}).get("test", [])),
          "compose: the replicas' healthcheck does not ask /ready")
    check(any(str(v).startswith("./models:/models") and str(v).endswith(":ro")
              for v in r.get("volumes", [])), "compose: the model is not mounted read-only")
    limit = r.get("deploy", {}).get("resources", {}).get("limits", {}).get("memory")
    check(limit is not None, "compose: the replicas have no memory limit (auto sizes from it)")
    secret = flag(r["command"], "--redis-secret-file") or ""
    names = [x if isinstance(x, str) else x.get("source") for x in r.get("secrets", [])]
    check(len(names) == 1 and secret == f"/run/secrets/{names[0]}",
          "compose: --redis-secret-file is not the service's one secret")
    check(set(names) <= set(c.get("secrets", {})), "compose: a secret the replicas use is undefined")
    check_redis_args(s["redis"].get("command", [])[1:], "compose redis")
    h = s["haproxy"]
    check(str(h.get("image", "")).startswith("haproxy:2.6"), "compose: HAProxy is not 2.6")
    check(any("haproxy/haproxy.cfg:" in str(v) for v in h.get("volumes", [])),
          "compose: HAProxy does not mount deploy/haproxy/haproxy.cfg")
    check(h.get("environment", {}).get("RAGKV_REPLICAS") == "ragkv",
          "compose: RAGKV_REPLICAS is not the replicas' service name")


def kubernetes():
    docs = []
    kust = load_all("k8s/kustomization.yaml")[0]
    for rel in kust.get("resources", []):
        check(os.path.exists(os.path.join(DEPLOY, "k8s", rel)), f"k8s: {rel} is missing")
        for d in load_all(os.path.join("k8s", rel)):
            for key in ("apiVersion", "kind", "metadata"):
                check(key in d, f"k8s {rel}: a document without {key}")
            docs.append(d)
    by = {(d.get("kind"), d.get("metadata", {}).get("name")): d for d in docs}
    need = [("Deployment", "ragkv"), ("Service", "ragkv"), ("Service", "ragkv-replicas"),
            ("PodDisruptionBudget", "ragkv"), ("Secret", "ragkv-redis-secret"),
            ("Deployment", "ragkv-redis"), ("Service", "ragkv-redis"),
            ("ConfigMap", "ragkv-haproxy"), ("Deployment", "ragkv-haproxy"),
            ("Service", "ragkv-lb"), ("PersistentVolumeClaim", "ragkv-models")]
    if not all([check(k in by, f"k8s: no {k[0]} {k[1]}") for k in need]):
        return
    dep = by[("Deployment", "ragkv")]
    pod = dep["spec"]["template"]
    labels = pod["metadata"]["labels"]
    check(dep["spec"]["selector"]["matchLabels"].items() <= labels.items(),
          "k8s: the Deployment's selector does not match its pods")
    spec = pod["spec"]
    (ctr,) = spec["containers"]
    grace = check_serve_args(ctr.get("args", []), "k8s ragkv")
    check(ctr.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/ready",
          "k8s: the readiness probe does not ask /ready")
    check(ctr.get("livenessProbe", {}).get("httpGet", {}).get("path") == "/health",
          "k8s: the liveness probe does not ask /health")
    pre = ctr.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_s = float(pre[1]) if pre[:1] == ["sleep"] else 0
    check(spec.get("terminationGracePeriodSeconds", 30) > pre_s + grace + 10,
          "k8s: terminationGracePeriodSeconds is not above preStop + --grace-s + 10 s")
    res = ctr.get("resources", {})
    req, lim = res.get("requests", {}), res.get("limits", {})
    check("memory" in lim and req.get("memory") == lim.get("memory"),
          "k8s: memory requests differ from limits (auto sizes the KV budget from the limit)")
    check(spec.get("securityContext", {}).get("runAsNonRoot") is True, "k8s: may run as root")
    mounts = {m["name"]: m for m in ctr.get("volumeMounts", [])}
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    models = [n for n, m in mounts.items() if m.get("mountPath") == "/models"]
    check(len(models) == 1 and mounts[models[0]].get("readOnly") is True,
          "k8s: the model volume is not mounted read-only at /models")
    secret_file = flag(ctr["args"], "--redis-secret-file") or ""
    sdir, skey = os.path.split(secret_file)
    smounts = [n for n, m in mounts.items() if m.get("mountPath") == sdir]
    sname = vols.get(smounts[0], {}).get("secret", {}).get("secretName") if smounts else None
    check(sname == "ragkv-redis-secret", "k8s: --redis-secret-file is not from the Secret")
    check(skey in by[("Secret", "ragkv-redis-secret")].get("stringData", {}),
          f"k8s: the Secret has no key {skey}")
    redis_url = flag(ctr["args"], "--redis") or ""
    check("//ragkv-redis:" in redis_url, "k8s: --redis does not name the ragkv-redis Service")
    for svc in ("ragkv", "ragkv-replicas"):
        sel = by[("Service", svc)]["spec"]["selector"]
        check(sel.items() <= labels.items(), f"k8s: Service {svc} does not select the pods")
    check(by[("Service", "ragkv-replicas")]["spec"].get("clusterIP") == "None",
          "k8s: ragkv-replicas is not headless")
    pdb = by[("PodDisruptionBudget", "ragkv")]["spec"]
    check(pdb["selector"]["matchLabels"].items() <= labels.items(),
          "k8s: the PodDisruptionBudget does not select the pods")
    check("maxUnavailable" in pdb or "minAvailable" in pdb, "k8s: an empty PodDisruptionBudget")
    rctr = by[("Deployment", "ragkv-redis")]["spec"]["template"]["spec"]["containers"][0]
    cap = check_redis_args(rctr.get("args", []), "k8s redis")
    rlim = rctr.get("resources", {}).get("limits", {}).get("memory")
    check(rlim is not None and mib(rlim) > cap, "k8s: Redis's memory limit is not above maxmemory")
    with open(os.path.join(DEPLOY, "haproxy", "haproxy.cfg")) as f:
        cfg = f.read()
    check(by[("ConfigMap", "ragkv-haproxy")]["data"].get("haproxy.cfg") == cfg,
          "k8s: the ConfigMap's haproxy.cfg differs from deploy/haproxy/haproxy.cfg")
    hctr = by[("Deployment", "ragkv-haproxy")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in hctr.get("env", [])}
    check(str(env.get("RAGKV_REPLICAS", "")).startswith("ragkv-replicas."),
          "k8s: HAProxy's RAGKV_REPLICAS is not the headless Service")


def dockerfile():
    with open(os.path.join(DEPLOY, "Dockerfile")) as f:
        lines = [l.strip() for l in f if l.strip() and not l.lstrip().startswith("#")]
    froms = [l.split()[1] for l in lines if l.upper().startswith("FROM ")]
    check(len(froms) >= 2, "Dockerfile: not multi-stage")
    check(all(f.startswith("debian:") for f in froms), "Dockerfile: a stage not on Debian")
    final = lines[max(i for i, l in enumerate(lines) if l.upper().startswith("FROM ")):]
    users = [l.split()[1] for l in final if l.upper().startswith("USER ")]
    check(users and users[-1] not in ("root", "0"), "Dockerfile: the image runs as root")
    check(not any(".gguf" in l for l in lines if l.upper().startswith(("COPY", "ADD"))),
          "Dockerfile: a model is baked into the image")
    check(any(l.upper().startswith("COPY --FROM=") for l in final),
          "Dockerfile: the final stage copies nothing from the build")


def sync_configmap():
    with open(os.path.join(DEPLOY, "haproxy", "haproxy.cfg")) as f:
        cfg = f.read()
    path = os.path.join(DEPLOY, "k8s", "haproxy.yaml")
    with open(path) as f:
        text = f.read()
    head, rest = text.split("  haproxy.cfg: |\n", 1)
    tail = rest[rest.index("\n---\n") + 1:]  # the next document
    body = "".join(("    " + l if l.strip() else "") + "\n" for l in cfg.rstrip("\n").split("\n"))
    with open(path, "w") as f:
        f.write(head + "  haproxy.cfg: |\n" + body + tail)


if sys.argv[1:] == ["--sync"]:
    sync_configmap()
for part in (compose, kubernetes, dockerfile):
    try:
        part()
    except Exception as e:  # a missing key or a file that does not parse
        failures.append(f"{part.__name__}: {type(e).__name__}: {e}")
if failures:
    print("\n".join(failures))
    sys.exit(1)
print("deploy/: docker-compose.yml, k8s/*.yaml and Dockerfile pass")
