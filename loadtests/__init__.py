"""The load suite. Every module, by what it is:

* The runner: `__main__` (`python -m loadtests list | run NAME | compare A B`), `scenarios`
  (each measurement as a named unit with tags: one module per scenario), `figures` (the one
  result schema, `figures.json`, and the comparison of two).
* Locust files (`locust -f loadtests/<file>.py`): `sustained` (open-model stages), `burst`
  (requests released together), and what they share inside Locust, `harness`, `client` (the
  HTTP side of one request), `timer` (sleeping to an intended send time) and `webui` (the
  shape's options and each run's verdict in Locust's web UI).
* Measurement programs (`python -m loadtests.<module>`), each on a rig of `sshpool.devhost.rig`:
  `bench` (the API against the raw ceiling; with `agent_bench`, agent mode's parts),
  `experiment` (a matrix with interleaved repeats; `verdict`, its bootstrap verdicts;
  `recommend`, its advice per setting of sshd_config.tuned), `soak`,
  `replicas` (API replicas behind nginx), `backend_bench` and `raw_matrix` (the pool alone),
  `accounts`, `certificates` and `handshakes` (many researcher accounts on one sshd), `cluster`
  (login-node faults), `files_bench`, `list_bench` and `transfer_fairness` (files),
  `live_latency` (live output), `cli_startup` (the `sshapi` command's start),
  `webhook_latency` (state change to webhook delivery), `outbox_cost` (the webhook outbox's
  cost to a job without webhooks), `portals_bench` (one change feed against polling 1,000
  running jobs), `metrics_cost` (what /metrics costs, old tree against new),
  `panels` (dashboard panels as pictures, from a real Prometheus).
* What they share: `server` (start the API for a measurement), `cpu` (`CpuMeter`: where the CPU
  went), `bystander` (another identity's short jobs beside a measurement), `schedule` (load
  shapes, pure), `records` (one record per request), `hdr` (HdrHistogram helpers), `summary`
  (records to a run's numbers), `report` (a run's directory, `reports/<time>-<name>/`),
  `plots`, and `webhook_receiver` (a receiver that checks signatures).

May import: the API through HTTP, plus its public seam: `api.local` (tokens, local limits and
issuer), `api.workers.serve` (run a server in a child process), `api.config` / `api.settings`
types; `sshpool` by public names for the raw-ceiling benchmark, and the dev rig
(`sshpool.devhost`) for the hosts it measures against. No private name of another package.
"""
