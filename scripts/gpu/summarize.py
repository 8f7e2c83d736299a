"""results.json + session.nvtrace + audit.log of an H200 run -> a markdown table (stdout).

    python3 scripts/gpu/summarize.py results.json session.nvtrace audit.log
"""
from __future__ import annotations

import json
import sys
from collections import Counter

GiB = 1 << 30
REFUSED_CONTROLS = {0x20800134, 0x20800136, 0x20803403}
REFUSED_ESCAPES = {"NV_ESC_RM_ACCESS_REGISTRY", "NV_ESC_SYS_PARAMS"}
REFUSED_CLASSES = {0x83DE}


def record_facts(path: str) -> dict:
    from devbroker.abi import nvtrace, registry
    from devbroker.abi.traceview import TraceDecoder, stats

    abi = registry.get("580.159.04")
    recs = nvtrace.read_file(path)
    st = stats(abi, recs)
    dec = TraceDecoder(abi)
    seen_refused = []
    for r in recs:
        ev = dec.decode(r)
        c = ev.call_in
        if r.type != 2 or c is None or c.value is None:
            continue
        if c.name in REFUSED_ESCAPES:
            seen_refused.append(c.name)
        if c.name == "NV_ESC_RM_CONTROL" and c.value.cmd in REFUSED_CONTROLS:
            seen_refused.append(hex(c.value.cmd))
        if c.name == "NV_ESC_RM_ALLOC" and c.value.hClass in REFUSED_CLASSES:
            seen_refused.append(hex(c.value.hClass))
    return {"records": dict(st["records"]), "errors": st["errors"][:5],
            "unknown": dict(st["unknown"]), "refused_ops_in_record": seen_refused,
            "controls": len(st["controls"]), "statuses": dict(st["statuses"])}


def mem(g) -> str:
    m = g.get("memory") if isinstance(g, dict) else None
    if not isinstance(m, dict):
        return str(m)
    return f"total {m['total'] / GiB:.2f} GiB, used {m['used'] / (1 << 20):.0f} MiB"


def gpus(x) -> str:
    if not isinstance(x, dict):
        return str(x)[:200]
    if x.get("init") != "ok":
        return str(x.get("init"))
    parts = [f"count {x.get('count')}"]
    for g in x.get("gpus", []):
        parts.append(f"{g.get('name')} {g.get('uuid')} {mem(g)} compute procs "
                     f"{g.get('compute_procs')}")
    return "; ".join(parts)


def main(res_path: str, rec_path: str, audit_path: str) -> int:
    r = json.load(open(res_path))
    try:
        rec = record_facts(rec_path)
    except Exception as e:
        rec = {"error": f"{type(e).__name__}: {e}"}
    denies = []
    try:
        for line in open(audit_path):
            d = json.loads(line)
            if d.get("event") == "deny":
                denies.append(f"{d.get('tenant')}: {d.get('what')}: {d.get('reason')}")
    except OSError:
        pass
    rows = [
        ("tenant sandbox (devbroker exec, seccomp stat shim)", r.get("sandbox")),
        ("relay process", r.get("relay_status")),
        ("broker CapEff", r.get("broker_capeff")),
        ("host nvidia-smi", r.get("host_smi_csv")),
        ("native pynvml", gpus(r.get("native_nvml"))),
        ("t16 pynvml", gpus(r.get("t16_nvml"))),
        ("t16 nvidia-smi rc / csv", f"{r.get('t16_smi_rc')} / {r.get('t16_smi_csv')}"),
        ("t16 quota probe", json.dumps(r.get("t16_quota"))[:600]),
        ("nogpu pynvml / nvidia-smi rc", f"{gpus(r.get('nogpu_nvml'))} / {r.get('nogpu_smi_rc')}"),
        ("t16 dangerous ops", json.dumps(r.get("t16_dangerous"))),
        ("t16 while holding 1 GiB", gpus(r.get("t16_while_holding"))),
        ("t8 concurrent", gpus(r.get("t8_concurrent"))),
        ("t8 nvidia-smi csv", r.get("t8_smi_csv")),
        ("t16 nvidia-smi csv while holding", r.get("t16_smi_holding")),
        ("host before hold", gpus(r.get("host_before_hold"))),
        ("host while holding", gpus(r.get("host_while_holding"))),
        ("host after SIGKILL", gpus(r.get("host_after_kill"))),
        ("host after all tenants", gpus(r.get("host_after_all"))),
        ("host after broker stop", gpus(r.get("host_after_stop"))),
        ("relay fds idle / holding / after kill / end",
         f"{r.get('relay_fds_idle')} / {r.get('relay_fds_holding')} / "
         f"{r.get('relay_fds_after_kill')} / {r.get('relay_fds_end')}"),
        ("record file", json.dumps(rec)[:900]),
    ]
    print("| check | result |\n| --- | --- |")
    for k, v in rows:
        print(f"| {k} | {str(v).replace('|', '/')} |")
    print("\n### Latency (µs)\n")
    print("| what | native p50 | relayed p50 | native p90 | relayed p90 |\n| --- | --- | --- | --- | --- |")
    for key in ("bench_nvml", "bench_control"):
        n, x = r.get("native_" + key) or {}, r.get("relayed_" + key) or {}
        if isinstance(n, dict) and isinstance(x, dict):
            print(f"| {n.get('what', key)} | {n.get('p50_us')} | {x.get('p50_us')} | "
                  f"{n.get('p90_us')} | {x.get('p90_us')} |")
    print("\n### Audit refusals\n")
    for d in Counter(denies).most_common(40):
        print(f"- {d[1]}x {d[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
