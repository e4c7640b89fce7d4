"""The load suite: Locust generators (`sustained`, `burst`, `harness`), the measurement driver
(`experiment`, `bench`, `soak`, `replicas`), and small pure modules (`schedule`, `records`,
`hdr`, `summary`, `report`, `plots`).

May import: the API through HTTP, plus its public seam: `api.local` (tokens, local limits and
issuer), `api.workers.serve` (run a server in a child process), `api.config` / `api.settings`
types; `sshpool` by public names for the raw-ceiling benchmark, and the dev rig
(`sshpool.devhost`) for the hosts it measures against. No private name of another package.
"""
