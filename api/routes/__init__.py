"""The HTTP routes, one module per resource: `jobs` (/v1/jobs), `hosts` (/v1/hosts), `ops`
(/healthz, /readyz, /metrics). Each module holds one `APIRouter` that `api.app` includes.

Routes stay thin: they read the request, call the services through `api.deps`' `Annotated`
aliases, and shape the answer (`api.schemas`). They may import `api.*` modules but never
`sshpool` internals or the dev rig; errors are raised as `api.problems.Problem`.
"""
