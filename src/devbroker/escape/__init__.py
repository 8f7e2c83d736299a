"""The escape-test harness (`devbroker escape-test`): attacks on tenant isolation, as data.

- :mod:`devbroker.escape.attacks` — the attack table: id, title, category, the seed
  standard's §5.3.1 item, the expected refusal, which layer should refuse, what audit line
  proves it, and the function that performs the attack with real syscalls;
- :mod:`devbroker.escape.tenant` — the tenant side (``python -m devbroker.escape.tenant``),
  run inside a sandbox: one JSON line per attack;
- :mod:`devbroker.escape.harness` — the host side: starts a broker, runs victim and
  attacker tenants, matches refusals to audit records, prints the table.

See docs/security.md for the threat model and the mapping to §5.3.1 e–f.
"""
