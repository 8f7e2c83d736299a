"""The Prometheus endpoint: the broker's state and counters in the exposition format.

The text is written by prometheus_client (the maintained client library): a custom collector
(:class:`BrokerCollector`) builds metric families at scrape time from

- the broker's own accounting, read through ``Broker.snapshot()`` (what ``devbroker status``
  shows): per tenant memory used and quota per GPU, open files, processes, RM objects,
  requests, requests delayed by the rate limit, tenant-memory accesses stalled;
- per-call counters and latency histograms (broker/callstats.py: recorded where the front
  ends call the broker);
- refusals by reason, escape attempts and the threshold alerts (broker/alerts.py);
- the host's view per GPU (its memory, what the backend has allocated on it).

The snapshot is taken on the trio thread (the broker's state is only ever touched there):
the HTTP server's threads ask for it with ``trio.from_thread``. The server is the standard
library's WSGI server with prometheus_client's WSGI app, with two limits of its own because a
tenant started with ``devbroker exec`` shares the host's network namespace and can connect to
a loopback address too: a connection that sends nothing is dropped after
:attr:`MetricsEndpoint.TIMEOUT` seconds, and at most :attr:`MetricsEndpoint.MAX_CONNECTIONS`
are served at a time (more are closed unanswered). What the endpoint shows (tenant names and
their usage) is readable by any local process that can reach it: docs/operations.md.
"""
from __future__ import annotations

import logging
import socket
import threading
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from socketserver import ThreadingMixIn

from devbroker.broker import preemption
from devbroker.broker.alerts import ALERTS

log = logging.getLogger("devbroker.metrics")

# Tenant labels (policy key `labels`) carried by the per-tenant memory and refusal series.
POD_LABELS = ("namespace", "pod", "container")


class BrokerCollector:
    """prometheus_client collector over one running broker (see module doc).

    ``take_snapshot`` returns a plain-data snapshot and must run on the broker's thread;
    the daemon passes a function that gets there from the HTTP thread."""

    def __init__(self, take_snapshot: Callable[[], dict[str, Any]]):
        self.take_snapshot = take_snapshot

    def describe(self):  # no describe-time collection (it would snapshot at registration)
        return []

    def collect(self):
        snap = self.take_snapshot()
        tenants = snap["tenants"]

        def gauge(name, doc, labels):
            return GaugeMetricFamily(name, doc, labels=labels)

        # The tenant's labels that name a Kubernetes pod, under the names dcgm-exporter and
        # HAMi's exporter give them, so that a cluster's dashboards join the series by pod
        # ("" where a tenant has none: Prometheus treats an empty label as absent).
        pod_of = {t["name"]: [t.get("labels", {}).get(k, "") for k in POD_LABELS]
                  for t in tenants if t.get("labels")}

        def pod(name):
            return pod_of.get(name, ["", "", ""])

        used = gauge("devbroker_tenant_memory_used_bytes",
                     "Device memory the tenant holds on a GPU (the broker's books)",
                     ["tenant", "gpu", *POD_LABELS])
        quota = gauge("devbroker_tenant_memory_quota_bytes",
                      "The tenant's device-memory quota on a GPU",
                      ["tenant", "gpu", *POD_LABELS])
        revoked = gauge("devbroker_tenant_revoked_memory_bytes",
                        "Memory the tenant still holds on a GPU a policy change took away",
                        ["tenant", "gpu", *POD_LABELS])
        managed = gauge("devbroker_tenant_managed_memory_bytes",
                        "Managed (nvidia-uvm) ranges the tenant maps: part of its used "
                        "memory on each of its GPUs", ["tenant", *POD_LABELS])
        pinned = gauge("devbroker_tenant_pinned_host_memory_bytes",
                       "Host memory the tenant's processes pin through the driver "
                       "(cudaHostAlloc, cudaHostRegister)", ["tenant", *POD_LABELS])
        pinned_limit = gauge("devbroker_tenant_pinned_host_memory_limit_bytes",
                             "The tenant's pinned_host_memory", ["tenant", *POD_LABELS])
        files = gauge("devbroker_tenant_open_files", "NVIDIA files the tenant has open",
                      ["tenant"])
        procs = gauge("devbroker_tenant_processes", "Processes of the tenant with open files",
                      ["tenant"])
        clients = gauge("devbroker_tenant_rm_clients", "RM root clients of the tenant",
                        ["tenant"])
        objects = gauge("devbroker_tenant_rm_objects", "RM objects of the tenant", ["tenant"])
        requests = CounterMetricFamily("devbroker_tenant_requests",
                                       "Calls of the tenant that reached the broker core",
                                       labels=["tenant"])
        limited = CounterMetricFamily("devbroker_tenant_rate_limited",
                                      "Calls delayed by the tenant's rate limit (delayed, never "
                                      "dropped)", labels=["tenant"])
        stalled = gauge("devbroker_tenant_memory_access_stalled",
                        "Accesses to the tenant's memory stuck in the kernel past their "
                        "deadline", ["tenant"])
        for t in tenants:
            name = t["name"]
            for g, m in t["memory"].items():
                used.add_metric([name, g, *pod(name)], m["used"])
                quota.add_metric([name, g, *pod(name)], m["quota"])
            for g, n in t.get("revoked_memory", {}).items():
                revoked.add_metric([name, g, *pod(name)], n)
            if "managed_memory" in t:
                managed.add_metric([name, *pod(name)], t["managed_memory"])
            if "pinned_host_memory" in t:
                pinned.add_metric([name, *pod(name)], t["pinned_host_memory"]["used"])
                pinned_limit.add_metric([name, *pod(name)], t["pinned_host_memory"]["limit"])
            files.add_metric([name], t["open_files"])
            procs.add_metric([name], len(t["processes"]))
            clients.add_metric([name], t["clients"])
            objects.add_metric([name], t["objects"])
            requests.add_metric([name], t["requests"])
            limited.add_metric([name], t["rate_limited"])
            stalled.add_metric([name], t["memory_stalled"])
        yield from (used, quota, revoked, managed, pinned, pinned_limit, files, procs, clients,
                    objects, requests, limited, stalled)

        calls = CounterMetricFamily(
            "devbroker_calls", "Calls from tenants by kind and verdict (ok, refused by the "
            "broker, error: an errno, continued: run by the tenant's own kernel context)",
            labels=["tenant", "op", "call", "command", "verdict"])
        for key, n in snap["calls"].items():
            calls.add_metric(list(key), n)
        yield calls
        latency = HistogramMetricFamily(
            "devbroker_call_duration_seconds", "Time the broker took for a call, by kind "
            "(from the front end handing it over to the reply)",
            labels=["op", "call", "command"])
        for key, (buckets, total) in snap["latency"].items():
            latency.add_metric(list(key), buckets, total)
        yield latency

        refusals = CounterMetricFamily("devbroker_refusals",
                                       "Refusals by tenant and reason (every one, also those "
                                       "the audit file's rate limit left out)",
                                       labels=["tenant", "reason", *POD_LABELS])
        for (tenant, reason), n in snap["refusals"].items():
            refusals.add_metric([tenant, reason, *pod(tenant)], n)
        yield refusals
        escapes = CounterMetricFamily("devbroker_escape_attempts",
                                      "Refusals only an escape attempt explains (another "
                                      "tenant's objects, files passed between sandboxes, host "
                                      "privilege) and quota-watch violations",
                                      labels=["tenant"])
        for tenant, n in snap["escape_attempts"].items():
            escapes.add_metric([tenant], n)
        yield escapes
        active = gauge("devbroker_alert_active",
                       "1 while a threshold of the policy's [broker.alerts] is passed",
                       ["alert", "tenant", "gpu"])
        for (alert, tenant, gpu), v in snap["alert_state"].items():
            active.add_metric([alert, tenant, gpu], v)
        yield active
        raised = CounterMetricFamily("devbroker_alerts_raised", "Times an alert started",
                                     labels=["alert", "tenant"])
        for (alert, tenant), n in snap["alerts_raised"].items():
            raised.add_metric([alert, tenant], n)
        yield raised
        thresholds = gauge("devbroker_alert_threshold",
                           "The running policy's alert thresholds (0: off)", ["alert"])
        for alert in ALERTS:
            thresholds.add_metric([alert], snap["thresholds"][alert])
        yield thresholds
        suppressed = CounterMetricFamily("devbroker_audit_suppressed",
                                         "Refusal records the audit log's per-tenant rate "
                                         "limit left out of the file (summarised there)")
        suppressed.add_metric([], snap["audit_suppressed"])
        yield suppressed

        gpu_total = gauge("devbroker_gpu_memory_total_bytes", "A GPU's memory (the host's view)",
                          ["gpu", "uuid", "name"])
        gpu_alloc = gauge("devbroker_gpu_memory_allocated_bytes",
                          "Device memory all tenants hold on a GPU (the broker's books)",
                          ["gpu"])
        gpu_backend = gauge("devbroker_gpu_memory_used_bytes",
                            "Device memory in use on a GPU as the backend reports it "
                            "(emulated backend: its own accounting)", ["gpu"])
        gpu_tenants = gauge("devbroker_gpu_tenants", "Tenants the policy gives a GPU", ["gpu"])
        for g in snap["gpus"]:
            idx = str(g["index"])
            gpu_total.add_metric([idx, g["uuid"], g["name"]], g["memory"])
            gpu_alloc.add_metric([idx], g["allocated"])
            if g.get("backend_used") is not None:
                gpu_backend.add_metric([idx], g["backend_used"])
            gpu_tenants.add_metric([idx], g["tenants"])
        yield from (gpu_total, gpu_alloc, gpu_backend, gpu_tenants)
        if "preemption" in snap:  # priority preemption (broker/preemption.py)
            yield from preemption.metric_families(snap["preemption"], gauge,
                                                  CounterMetricFamily)
        info = GaugeMetricFamily("devbroker_info", "The running broker",
                                 labels=["backend", "driver", "pid"])
        info.add_metric([snap["backend"], snap["driver"], str(snap["pid"])], 1)
        yield info
        up = gauge("devbroker_start_time_seconds", "When this broker process started serving "
                   "(a live upgrade starts a new one)", [])
        up.add_metric([], snap["started"])
        yield up


def metrics_snapshot(broker, stats, monitor, audit, *, started: float) -> dict[str, Any]:
    """Plain data for one scrape (runs on the broker's thread; cheap copies only)."""
    import os

    snap = broker.snapshot()
    tenants = snap["tenants"]
    backend = broker.backend
    backend_used = backend.memory_in_use()  # None where the driver counts (real)
    gpus = []
    for i, g in enumerate(backend.gpus()):
        idx = getattr(g, "index", i)
        gpus.append({
            "index": idx, "uuid": getattr(g, "uuid", ""), "name": getattr(g, "name", ""),
            "memory": int(getattr(g, "memory_bytes", 0) or 0),
            "allocated": sum(int(t["memory"].get(str(idx), {}).get("used", 0))
                             + int(t.get("revoked_memory", {}).get(str(idx), 0))
                             for t in tenants),
            "backend_used": (backend_used.get(idx) if isinstance(backend_used, dict) else None),
            "tenants": sum(1 for t in tenants if idx in t["gpus"]),
        })
    cfg = broker.policy.broker.alerts
    return {
        "tenants": tenants, "backend": snap["backend"], "driver": snap["driver"],
        "pid": os.getpid(), "started": started, "gpus": gpus,
        "calls": dict(stats.calls), "latency": stats.histograms(),
        "refusals": dict(monitor.refusals), "escape_attempts": dict(monitor.escape_attempts),
        "alert_state": dict(monitor.state), "alerts_raised": dict(monitor.raised),
        "thresholds": {"quota": cfg.quota_percent, "refusal_rate": cfg.refusals_per_minute,
                       "escape_attempts": cfg.escape_attempts},
        "audit_suppressed": audit.suppressed_total,
        "preemption": snap["preemption"],
    }


class _Handler(WSGIRequestHandler):
    timeout = 5.0  # seconds a connection may take to send its request

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    max_connections = 8

    def __init__(self, *a, **kw):
        self._busy = threading.BoundedSemaphore(self.max_connections)
        super().__init__(*a, **kw)

    def process_request(self, request, client_address):
        if not self._busy.acquire(blocking=False):
            self.shutdown_request(request)  # over the limit: closed unanswered
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._busy.release()


class MetricsEndpoint:
    """The HTTP endpoint (a thread), started and stopped by the daemon."""

    TIMEOUT = _Handler.timeout
    MAX_CONNECTIONS = _Server.max_connections

    def __init__(self, collector: BrokerCollector):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.bound: tuple[str, int] | None = None  # kept while paused (live upgrade)

    @property
    def address(self) -> tuple[str, int] | None:
        return self.bound

    @property
    def url(self) -> str | None:
        if self.address is None:
            return None
        host, port = self.address
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}/metrics"

    def start(self, host: str, port: int, *, sock: socket.socket | None = None) -> None:
        """Serve on host:port, or on an already bound and listening socket (a live upgrade
        passes the predecessor's, so no scrape finds the port closed)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        class Server(_Server):
            address_family = family

        app = make_wsgi_app(self.registry)
        if sock is None:
            server = make_server(host, port, app, Server, handler_class=_Handler)
        else:
            server = Server((host, port), _Handler, bind_and_activate=False)
            server.socket.close()
            server.socket = sock
            # What server_bind() would have set (without its reverse DNS lookup).
            server.server_address = sock.getsockname()
            server.server_name, server.server_port = host, server.server_address[1]
            server.setup_environ()
            server.set_app(app)
        self.server = server
        self.bound = tuple(server.server_address[:2])
        self._thread = threading.Thread(target=server.serve_forever, name="devbroker-metrics",
                                        daemon=True)
        self._thread.start()

    def pause(self) -> socket.socket | None:
        """Stop answering; the listening socket stays open (for a successor). Blocking."""
        if self.server is None:
            return None
        self.server.shutdown()
        sock = self.server.socket
        self.server = None
        return sock

    def stop(self) -> None:
        sock = self.pause()
        if sock is not None:
            sock.close()
        self.bound = None
