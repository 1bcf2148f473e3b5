"""Secrets kept out of the model card: the values of command-line options and YAML keys whose
name says they hold one (``--hub_token``, ``--wandb_api_key``, ``hub_token:``) are shown as
``***``; everything else is left as it was, so the card's command still reproduces the run
once the reader supplies their own secret.

A name holds a secret when its last word (split at ``_`` and ``-``) is one of
``SECRET_WORDS``: a name that only contains such a word (``average_tokens_across_devices``,
``include_num_input_tokens_seen``) is an ordinary option, and a tokenizer's special tokens
(``eos_token``, ``pad_token``) are text the run needs, not secrets.

A value written inline as a JSON or YAML flow collection (``model_init_kwargs: {token: X}``,
``--model_init_kwargs '{"token": "X"}'``) is read, its secret keys are shown as ``***`` at any
depth, and it is written back in the same syntax; one that cannot be read but names a secret
key is shown as ``***`` whole.
"""

from __future__ import annotations

import json
import re

import yaml

REDACTED = "***"
SECRET_WORDS = frozenset(
    {"token", "secret", "key", "apikey", "password", "passwd", "credential", "credentials"}
)
_SPECIAL_TOKENS = frozenset(
    f"{kind}_token" for kind in ("bos", "eos", "pad", "unk", "sep", "cls", "mask")
)
# A YAML (or JSON) mapping line: its indent, an optional comment mark or list dash, the key
# (quoted or not), the colon, and the value to the end of the line.
_YAML_KEY = re.compile(
    r"""^(?P<head>(?P<indent>[ \t]*)(?:\#[ \t]*)?(?:-[ \t]+)?
    (?P<quote>["']?)(?P<name>[\w.-]+)(?P=quote)[ \t]*:)(?P<value>.*?)(?P<comma>,?)[ \t]*$""",
    re.VERBOSE,
)
# A line that is itself a flow collection: a list item (``- {token: X}``) or a one-line JSON file.
_FLOW_LINE = re.compile(
    r"""^(?P<head>[ \t]*(?:\#[ \t]*)?(?:-[ \t]+)?)(?P<value>[{\[].*?)(?P<comma>,?)[ \t]*$"""
)
# A key inside flow text that could not be read: ``token:``, ``"api_key" :``.
_FLOW_KEY = re.compile(r"""(?P<quote>["']?)(?P<name>[\w.-]+)(?P=quote)[ \t]*:""")


def is_secret_name(name: str) -> bool:
    """Whether an option (``--hub-token``) or key (``hub_token``) names a secret."""
    name = name.lstrip("-").lower().replace("-", "_")
    return name.rsplit("_", 1)[-1] in SECRET_WORDS and name not in _SPECIAL_TOKENS


def _is_flow(text: str) -> bool:
    return text.lstrip()[:1] in ("{", "[")


def _redact_parsed(value):
    """``(value, changed)``: a parsed value with the value of each secret key, at any depth,
    replaced by ``REDACTED``; a string that is itself flow text (JSON inside YAML) is read too."""
    if isinstance(value, dict):
        out, changed = {}, False
        for key, item in value.items():
            if isinstance(key, str) and is_secret_name(key):
                out[key], changed = REDACTED, changed or item != REDACTED
            else:
                out[key], item_changed = _redact_parsed(item)
                changed = changed or item_changed
        return out, changed
    if isinstance(value, list):
        items = [_redact_parsed(item) for item in value]
        return [item for item, _ in items], any(changed for _, changed in items)
    if isinstance(value, str) and _is_flow(value):
        redacted = redact_flow(value)
        return redacted, redacted != value
    return value, False


def _yaml_flow(value) -> str:
    text = yaml.safe_dump(
        value, default_flow_style=True, sort_keys=False, width=float("inf"), allow_unicode=True
    )
    return text.removesuffix("\n...\n").rstrip("\n")


def redact_flow(text: str) -> str:
    """``text``, a JSON or YAML flow value (``{token: X}``, ``[{"api_key": "X"}]``), with the
    value of each secret key replaced by ``REDACTED`` and written back in the syntax it came in
    (JSON stays JSON); unchanged, byte for byte, when it holds no secret. Text that cannot be
    read but names a secret key (``{token: X`` cut short) is replaced whole."""
    try:
        value, dump = json.loads(text), lambda v: json.dumps(v, ensure_ascii=False)
    except ValueError:
        try:
            value, dump = yaml.safe_load(text), _yaml_flow
        except yaml.YAMLError:
            named = (match["name"] for match in _FLOW_KEY.finditer(text))
            return REDACTED if any(is_secret_name(name) for name in named) else text
    redacted, changed = _redact_parsed(value)
    return dump(redacted) if changed else text


def _redact_arg(arg: str) -> str:
    """One argument that is not a secret option's value: a flow value (``'{"token": "X"}'``,
    ``--model_init_kwargs={...}``) with its secret keys redacted."""
    name, equals, value = arg.partition("=")
    if arg.startswith("-") and equals and _is_flow(value):
        return f"{name}={redact_flow(value)}"
    return redact_flow(arg) if _is_flow(arg) else arg


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the value of each secret option replaced by ``REDACTED``, in both
    forms: ``--hub_token VALUE`` and ``--hub_token=VALUE``, and the secret keys inside a
    JSON or YAML flow value (``--model_init_kwargs '{"token": "X"}'``) redacted."""
    out = []
    value_follows = False
    for arg in argv:
        if value_follows and not arg.startswith("--"):  # an option here means no value was given
            out.append(REDACTED)
            value_follows = False
            continue
        value_follows = False
        if arg.startswith("-"):
            name, equals, _ = arg.partition("=")
            if is_secret_name(name):
                if equals:
                    out.append(f"{name}={REDACTED}")
                    continue
                value_follows = True
        out.append(_redact_arg(arg))
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def redact_yaml(text: str) -> str:
    """``text`` (a recipe or config file) with the value of each secret key replaced by
    ``"***"`` (quoted: YAML reads a bare ``*`` as an alias), commented-out keys included, and
    the lines a secret's value continues on (a block scalar, a folded string) left out. A
    value written as a flow collection has its secret keys redacted (``redact_flow``)."""
    out = []
    secret_indent = None  # the indent of the secret key whose continuation lines are dropped
    for line in text.splitlines(keepends=True):
        if secret_indent is not None:
            if line.strip() and _indent(line) > secret_indent:
                continue
            if line.strip():
                secret_indent = None
        body = line.rstrip("\r\n")
        end = line[len(body) :]
        match = _YAML_KEY.match(body)
        if match and is_secret_name(match["name"]):
            out.append(f'{match["head"]} "{REDACTED}"{match["comma"]}{end}')
            secret_indent = _indent(line)
            continue
        match = match or _FLOW_LINE.match(body)
        value = match["value"].strip() if match else ""
        if _is_flow(value.lstrip("'\"")):  # a flow collection, or JSON in a quoted string
            shown = redact_flow(value)
            if shown != value:
                cut_short = shown == REDACTED
                # A flow collection cut short (its comma included) continues on the lines
                # below it: they are dropped.
                tail = "" if cut_short else match["comma"]
                shown = f'"{REDACTED}"' if cut_short else shown
                space = " " if match["head"].endswith(":") else ""
                out.append(f"{match['head']}{space}{shown}{tail}{end}")
                secret_indent = _indent(line) if cut_short else None
                continue
        out.append(line)
    return "".join(out)
