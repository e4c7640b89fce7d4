"""Who may run what where: identity -> policy rule, templates, and admission.

`Policy.admit` is the whole of admission that needs no state: host known (422) and allowed
(403), batch only where a scheduler runs (422), raw shell lines and templates allowed (403),
template parameters valid (422), stdin and command sizes (413), the timeout capped. It creates
nothing. The stateful rest (idempotency replay, the caller's rate and concurrent-job cap, shared
by replicas) is applied by `JobService.submit` (api/jobs/service.py, api/quota.py) to its
`Admission`.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import quote

from api.auth import Principal
from api.config import (
    PLACEHOLDER,
    Account,
    ApiConfig,
    Config,
    HostConfig,
    ParamSpec,
    PolicyRule,
    TemplateConfig,
)
from api.problems import Problem
from api.schemas import JobRequest
from sshpool import Target


def _listed(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


# The identity part of a certificate's key id: at most this long (sshd logs the key id).
MAX_KEY_ID_IDENTITY = 160


def key_id_identity(issuer: str, subject: str) -> str:
    """The caller's identity as a certificate's key id names it: `subject@issuer`,
    percent-encoded to printable ASCII without spaces or '/' (the key id is one token in sshd's
    log); a longer one keeps its head and a hash of the whole, so it still names one identity."""
    text = quote(f"{subject}@{issuer}", safe="@:.-_~+=,")
    if len(text) > MAX_KEY_ID_IDENTITY:
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        text = f"{text[: MAX_KEY_ID_IDENTITY - 17]}~{digest}"
    return text


def account_refused(detail: str) -> Problem:
    return Problem(403, "account-refused", "No account for you on this host", detail)


def host_details(who: Principal, api: ApiConfig) -> bool:
    """Whether `who` sees where hosts are (a host's address, its pools' `sshd`, login node
    names, a job's `node`): admins always, others unless `api.host_details_require_admin`."""
    return who.is_admin or not api.host_details_require_admin


@dataclass(frozen=True, slots=True)
class Grant:
    """What one identity may do on one host, resolved from the first matching rule."""

    host_name: str
    host: HostConfig
    rule: PolicyRule
    target: Target
    # The account is the token's claim (a certificate host), not the configuration's: it is
    # looked up on the host before its first SSH work (api/accounts.py).
    claimed: bool = False

    @property
    def shell(self) -> bool:
        return _listed(self.host_name, self.rule.shell_hosts)


@dataclass(frozen=True, slots=True)
class Admission:
    """An admitted request: what to run (`command`: argv or a shell line; empty for a batch
    job, whose script travels in the request), as whom (`grant`), with which stdin and timeout."""

    grant: Grant
    command: str | list[str]
    stdin: bytes | None
    timeout: float

    @property
    def rule(self) -> PolicyRule:
        return self.grant.rule

    @property
    def target(self) -> Target:
        return self.grant.target


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


class Policy:
    def __init__(self, config: Config) -> None:
        self.config = config
        # The first rule of each literal (issuer, subject), and the glob rules in order, each
        # with its position: a site with a rule per researcher (thousands) looked each request
        # up through every rule with fnmatch (9 % of the API's busy CPU in py-spy's profile of
        # a 1,000-account burst). The first matching rule still wins.
        self._literal: dict[tuple[str, str], tuple[int, PolicyRule]] = {}
        self._globs: list[tuple[int, PolicyRule]] = []
        for i, rule in enumerate(config.policy):
            if _is_glob(rule.issuer) or _is_glob(rule.subject):
                self._globs.append((i, rule))
            else:
                self._literal.setdefault((rule.issuer, rule.subject), (i, rule))
        # Per certificate host, the accounts the configuration names: its own (`username`:
        # probes, the scheduler's tracker) and each one a rule maps. A token's claim never
        # names them: they are the API's or the rules' to give, not the caller's to take.
        self._configured = {
            name: frozenset(t.username for t in self.targets(name))
            for name, host in config.hosts.items()
            if host.certificates is not None
        }

    def rule_for(self, who: Principal) -> PolicyRule | None:
        """The first rule whose issuer and subject patterns match the caller."""
        if who.handle is not None:
            return None  # a job handle's bearer: no rule, however wide its patterns
        return self.rule_of(who.issuer, who.subject)

    def rule_of(self, issuer: str, subject: str) -> PolicyRule | None:
        """The first rule matching an identity (`rule_for` without a caller: a job's or a
        webhook's owner, whose token is long gone)."""
        literal = self._literal.get((issuer, subject))
        first = literal[0] if literal else len(self.config.policy)
        for i, rule in self._globs:
            if i >= first:
                break
            if fnmatchcase(issuer, rule.issuer) and fnmatchcase(subject, rule.subject):
                return rule
        return literal[1] if literal else None

    def webhook_url_allowed(self, owner: tuple[str, str], url: str) -> bool:
        """Whether the owner's rule lets their webhooks call `url` (its `webhook_urls`); an
        identity without a rule (an admin's, say) has only the server's [webhooks] limits. Asked
        at creation and again before every delivery: a rule narrowed since stops the calls."""
        rule = self.rule_of(*owner)
        return rule is None or _listed(url, rule.webhook_urls)

    def visible_hosts(self, who: Principal) -> list[str]:
        """Hosts the caller may use; admins see every host."""
        if who.is_admin:
            return list(self.config.hosts)
        rule = self.rule_for(who)
        if rule is None:
            return []
        return [name for name in self.config.hosts if _listed(name, rule.hosts)]

    def grant(self, who: Principal, host_name: str) -> Grant:
        """The grant to run on `host_name`, or 422 (no such host) / 403 (not for this caller)."""
        host = self.config.hosts.get(host_name)
        if host is None:
            raise Problem(422, "unknown-host", "Unknown host", f"no host named {host_name!r}")
        rule = self.rule_for(who)
        if rule is None or not _listed(host_name, rule.hosts):
            raise Problem(
                403, "host-forbidden", "Host not allowed", f"you may not use {host_name!r}"
            )
        account = rule.accounts.get(host_name)
        certs = host.certificates
        if certs is None:
            return Grant(host_name, host, rule, host.target(account))
        # A certificate host: the caller's own account (their token's claim) unless their
        # rule maps a fixed one, checked here, before any SSH work.
        if account is None:
            if who.account is None:
                raise account_refused(
                    f"host {host_name!r} runs each caller as their own account, and your token "
                    "names none (your identity provider's account claim is missing)"
                )
            problem = certs.account_problem(who.account)
            if problem is None and who.account in self._configured[host_name]:
                problem = "an account this host's configuration reserves"
            if problem is not None:
                raise account_refused(f"the account your token names: {problem}")
            identity = key_id_identity(who.issuer, who.subject)
            target = host.target(Account(username=who.account), identity)
            return Grant(host_name, host, rule, target, claimed=True)
        identity = key_id_identity(who.issuer, who.subject)
        return Grant(host_name, host, rule, host.target(account, identity))

    def accounts_of(self, who: Principal) -> set[str]:
        """Every account `who` would run as on some host: the one their token's claim names (a
        certificate host's default), each one their rule maps, and the own account of each key
        host their rule allows without mapping one. What a revocation by account refuses."""
        names = {who.account} if who.account else set()
        rule = self.rule_for(who)
        if rule is None:
            return names
        for name, host in self.config.hosts.items():
            if not _listed(name, rule.hosts):
                continue
            mapped = rule.accounts.get(name)
            if mapped is not None:
                names.add(mapped.username)
            elif host.certificates is None:
                names.add(host.username)
        return names

    def targets(self, host_name: str) -> list[Target]:
        """Every target configured on that host: its default account's, then each account a
        policy rule maps to it (duplicates removed). What the host's pools and health are."""
        host = self.config.hosts.get(host_name)
        if host is None:
            return []
        accounts = [
            None,
            *(r.accounts[host_name] for r in self.config.policy if host_name in r.accounts),
        ]
        return list(dict.fromkeys(map(host.target, accounts)))

    def sshd_targets(self, host_name: str) -> list[Target]:
        """The targets of every configured host that names the same address and port as this
        one: the pool's per-sshd budget is shared by all of them, so the start-up check and the
        doctor count them together. (Names that differ but resolve to one address are one sshd
        to the pool too; this static count cannot see that: docs/operations.md.)"""
        host = self.config.hosts.get(host_name)
        if host is None:
            return []
        where = (host.hostname, host.port)
        names = [n for n, h in self.config.hosts.items() if (h.hostname, h.port) == where]
        return list(dict.fromkeys(t for n in names for t in self.targets(n)))

    def target_of(
        self, host_name: str, name: str, owner: tuple[str, str] | None = None
    ) -> Target | None:
        """The configured target whose `str()` is `name` (what a job records) on that host: to
        act for a job later as the account that started it, whoever asks. On a certificate
        host, that account (still an account allowed there) with a certificate naming the
        job's `owner` (issuer, subject)."""
        host = self.config.hosts.get(host_name)
        certs = host.certificates if host is not None else None
        if host is None or certs is None:
            return next((t for t in self.targets(host_name) if str(t) == name), None)
        username = name.partition("@")[0]
        target = host.target(Account(username=username))
        mapped = {t.username for t in self.targets(host_name)}
        if str(target) != name or (username not in mapped and certs.account_problem(username)):
            return None
        identity = key_id_identity(*owner) if owner is not None else ""
        return host.target(Account(username=username), identity)

    def pools(self, host_name: str, stats: dict[Target, dict[str, Any]]) -> list[dict[str, Any]]:
        """The pool stats of that host's targets: its configured ones (on each login node of a
        host with several), and on a certificate host every caller's account (their targets
        share the host's CA)."""
        host = self.config.hosts.get(host_name)
        certs = host.certificates if host is not None else None
        if certs is None:
            # A host with several login nodes: a pool per account and node.
            pools = [t.node_target(n) for t in self.targets(host_name) for n in t.nodes]
            return [stats[t] for t in pools or self.targets(host_name) if t in stats]
        return [s for t, s in stats.items() if t.ca is certs.ca]

    def admit(self, who: Principal, body: JobRequest) -> Admission:
        """Admit `body` for `who` or raise the Problem that says why not (module docstring)."""
        grant = self.grant(who, body.host)
        if body.batch is not None:
            if not grant.shell:
                # A batch script is a shell script: the same permission as a raw shell line.
                raise Problem(
                    403,
                    "shell-forbidden",
                    "Batch scripts not allowed",
                    f"batch scripts are shell scripts, not allowed for you on {body.host!r}",
                )
            if grant.host.scheduler is None:
                raise Problem(
                    422,
                    "no-scheduler",
                    "Host takes no batch jobs",
                    f"host {body.host!r} has no scheduler configured: send argv or a template",
                )
            command: str | list[str] = []
        else:
            command = self._command(grant, body)
        api = self.config.api
        stdin = body.stdin.encode() if body.stdin is not None else None
        if stdin is not None and len(stdin) > api.max_stdin_bytes:
            raise Problem(
                413, "too-large", "stdin too large", f"at most {api.max_stdin_bytes} bytes"
            )
        size = len(command.encode()) if isinstance(command, str) else sum(map(len, command))
        if size > api.max_argv_bytes:
            raise Problem(
                413, "too-large", "Command too large", f"at most {api.max_argv_bytes} bytes"
            )
        timeout = min(body.timeout or api.default_timeout, grant.rule.max_timeout)
        return Admission(grant, command, stdin, timeout)

    def _command(self, grant: Grant, body: JobRequest) -> str | list[str]:
        if body.argv is not None:
            if not _listed(body.argv[0], grant.rule.programs):
                raise Problem(
                    403,
                    "program-forbidden",
                    "Program not allowed",
                    f"{body.argv[0]!r} may not run as argv on {body.host!r}: use a template",
                )
            return body.argv
        if body.command is not None:
            if not grant.shell:
                raise Problem(
                    403,
                    "shell-forbidden",
                    "Raw shell lines not allowed",
                    f"send argv or a template: raw shell lines are not allowed on {body.host!r}",
                )
            return body.command
        assert body.template is not None
        template = self.config.templates.get(body.template)
        if template is None:
            raise Problem(422, "unknown-template", "Unknown template", f"no {body.template!r}")
        if not self.template_allowed(grant, body.template):
            raise Problem(403, "template-forbidden", "Template not allowed", body.template)
        return render(body.template, template, body.params or {})

    def shell_allowed(self, who: Principal, host_name: str) -> bool:
        rule = self.rule_for(who)
        return rule is not None and _listed(host_name, rule.shell_hosts)

    def template_allowed(self, grant: Grant, name: str) -> bool:
        return _listed(name, grant.rule.templates)


def _invalid(detail: str) -> Problem:
    return Problem(422, "invalid-param", "Invalid template parameter", detail)


def _check(name: str, spec: ParamSpec, value: Any) -> str:
    """Validate one parameter value and render it as one argv string."""
    if spec.type == "bool":
        if not isinstance(value, bool):
            raise _invalid(f"{name}: expected true or false")
        return "true" if value else "false"
    if spec.type in ("int", "float"):
        ok = isinstance(value, int) if spec.type == "int" else isinstance(value, int | float)
        finite = not isinstance(value, float) or math.isfinite(value)
        if not ok or isinstance(value, bool) or not finite:
            raise _invalid(f"{name}: expected {spec.type}")
        low, high = spec.min, spec.max
        if (low is not None and value < low) or (high is not None and value > high):
            raise _invalid(f"{name}: must be between {low} and {high}")
        return str(value)
    if not isinstance(value, str):
        raise _invalid(f"{name}: expected a string")
    if "\0" in value or len(value) > spec.max_length:
        raise _invalid(f"{name}: NUL byte or longer than {spec.max_length}")
    if spec.choices is not None and value not in spec.choices:
        raise _invalid(f"{name}: one of {spec.choices}")
    if spec.pattern is not None and not re.fullmatch(spec.pattern, value):
        raise _invalid(f"{name}: does not match {spec.pattern!r}")
    return value


def render(name: str, template: TemplateConfig, params: dict[str, Any]) -> list[str]:
    """The argv of a template call. Each value stays inside the argv element the operator wrote,
    so it can never split into several arguments; a string value starting with '-' is refused
    unless it follows a literal "--" (end of options) or the parameter allows it."""
    unknown = set(params) - set(template.params)
    if unknown:
        raise Problem(
            422, "invalid-param", "Unknown template parameter", f"{name}: {sorted(unknown)}"
        )
    values: dict[str, str] = {}
    for pname, spec in template.params.items():
        if pname in params:
            values[pname] = _check(pname, spec, params[pname])
        elif spec.default is not None:
            values[pname] = _check(pname, spec, spec.default)
        elif spec.required:
            raise Problem(422, "invalid-param", "Missing template parameter", f"{name}: {pname}")
    argv: list[str] = []
    after_dashdash = False
    for element in template.argv:
        names = PLACEHOLDER.findall(element)
        if any(n not in values for n in names):
            continue  # an optional parameter left out drops its element
        rendered = PLACEHOLDER.sub(lambda m: values[m.group(1)], element)
        # The rendered element decides, not the first placeholder: with "{dir}{name}", an
        # empty dir lets name's '-' lead. A '-' the operator wrote first is theirs.
        if rendered.startswith("-") and not element.startswith("-") and not after_dashdash:
            leader = _leading_param(element, values)
            if leader is None or not template.params[leader].allow_leading_dash:
                who = leader or "an empty parameter"
                raise _invalid(f"{who}: would start an argument with '-' (read as an option)")
        argv.append(rendered)
        after_dashdash = after_dashdash or element == "--"
    return argv


def _leading_param(element: str, values: dict[str, str]) -> str | None:
    """The parameter whose value gives the first character of the rendered element; None when
    it is literal text the operator wrote after empty values."""
    pos = 0
    for match in PLACEHOLDER.finditer(element):
        if match.start() != pos:
            return None  # literal text comes first
        if values[match.group(1)]:
            return match.group(1)
        pos = match.end()
    return None
