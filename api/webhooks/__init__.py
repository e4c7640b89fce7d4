"""Webhooks (issue 43, docs/portals.md): an identity's job state changes POSTed to its
receivers after the Standard Webhooks specification, durably, once per event across replicas,
to destinations the configuration allows.

Modules: `config` (`[webhooks]`), `safety` (which URLs and addresses may be called), `service`
(create, list, delete: the routes' face), `deliver` (the outbox's deliverer, a supervised task
of every process). Imports nothing here, so that api/config.py can import `config` alone.
"""
