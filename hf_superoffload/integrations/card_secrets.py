"""Secrets kept out of the model card: the values of command-line options and YAML keys whose
name says they hold one (``--hub_token``, ``--wandb_api_key``, ``hub_token:``) are shown as
``***``; everything else is left as it was, so the card's command still reproduces the run
once the reader supplies their own secret.

A name holds a secret when its last word (split at ``_`` and ``-``) is one of
``SECRET_WORDS``: a name that only contains such a word (``average_tokens_across_devices``,
``include_num_input_tokens_seen``) is an ordinary option, and a tokenizer's special tokens
(``eos_token``, ``pad_token``) are text the run needs, not secrets.
"""

from __future__ import annotations

import re

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


def is_secret_name(name: str) -> bool:
    """Whether an option (``--hub-token``) or key (``hub_token``) names a secret."""
    name = name.lstrip("-").lower().replace("-", "_")
    return name.rsplit("_", 1)[-1] in SECRET_WORDS and name not in _SPECIAL_TOKENS


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the value of each secret option replaced by ``REDACTED``, in both
    forms: ``--hub_token VALUE`` and ``--hub_token=VALUE``."""
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
        out.append(arg)
    return out


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def redact_yaml(text: str) -> str:
    """``text`` (a recipe or config file) with the value of each secret key replaced by
    ``"***"`` (quoted: YAML reads a bare ``*`` as an alias), commented-out keys included, and
    the lines a secret's value continues on (a block scalar, a folded string) left out."""
    out = []
    secret_indent = None  # the indent of the secret key whose continuation lines are dropped
    for line in text.splitlines(keepends=True):
        if secret_indent is not None:
            if line.strip() and _indent(line) > secret_indent:
                continue
            if line.strip():
                secret_indent = None
        match = _YAML_KEY.match(line.rstrip("\r\n"))
        if match and is_secret_name(match["name"]):
            end = line[len(line.rstrip("\r\n")) :]
            out.append(f'{match["head"]} "{REDACTED}"{match["comma"]}{end}')
            secret_indent = len(match["indent"])
            continue
        out.append(line)
    return "".join(out)
