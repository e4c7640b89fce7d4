"""Who may run what where: identity -> policy rule, templates. (Rates and caps: api/quota.py.)"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from api.auth import Principal
from api.config import PLACEHOLDER, Config, HostConfig, ParamSpec, PolicyRule, TemplateConfig
from api.problems import Problem
from sshpool.target import Target


def _listed(name: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


@dataclass(frozen=True, slots=True)
class Grant:
    """What one identity may do on one host, resolved from the first matching rule."""

    host_name: str
    host: HostConfig
    rule: PolicyRule
    target: Target

    @property
    def shell(self) -> bool:
        return _listed(self.host_name, self.rule.shell_hosts)


class Policy:
    def __init__(self, config: Config) -> None:
        self.config = config

    def rule_for(self, who: Principal) -> PolicyRule | None:
        for rule in self.config.policy:
            if fnmatchcase(who.issuer, rule.issuer) and fnmatchcase(who.subject, rule.subject):
                return rule
        return None

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
        return Grant(host_name, host, rule, host.target(rule.accounts.get(host_name)))

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

    def target_of(self, host_name: str, name: str) -> Target | None:
        """The configured target whose `str()` is `name` (what a job records) on that host: to
        act for a job later as the account that started it, whoever asks."""
        return next((t for t in self.targets(host_name) if str(t) == name), None)

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
        lead = PLACEHOLDER.match(element)
        if lead and not after_dashdash:
            pname = lead.group(1)
            if values[pname].startswith("-") and not template.params[pname].allow_leading_dash:
                raise _invalid(f"{pname}: may not start with '-' (it would be read as an option)")
        argv.append(PLACEHOLDER.sub(lambda m: values[m.group(1)], element))
        after_dashdash = after_dashdash or element == "--"
    return argv
