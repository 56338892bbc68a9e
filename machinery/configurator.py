"""
Typed configuration from config files and command-line overrides, nanoGPT style:

    python train.py config/train_shakespeare_char.py --batch_size=32 --compile=False

Each script describes its settings as a dataclass whose fields carry a help text (`name: type = setting(default,
"help")`). Config files hold plain `key = value` lines of Python literals, read with ast.literal_eval: parsed,
never executed. Later sources override earlier ones: dataclass defaults, then config files in order, then
--key=value arguments (--key alone: True, for a True/False setting); given() tells which a file or an argument set.
Any mistake raises UserError with one line naming the key (errors.py: `error: ...` on stderr, exit status 2).
Not here: each script's settings (its own dataclass) and the checks between them (the scripts').
"""

import ast
import dataclasses
import sys
import typing

from machinery.errors import UserError


def setting(default, help):
    """A settings field: its default and the help text that --help shows."""
    return dataclasses.field(default=default, metadata={"help": help})


def check_positive(cfg, *names):
    """A one-line error for the first of cfg's settings names that is not above 0 (None: unset, not checked)."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and not value > 0:  # (not value > 0: NaN too)
            raise UserError(f"{name} must be positive, got {value}")


def check_not_negative(cfg, *names):
    """A one-line error for the first of cfg's settings names that is below 0 (None: unset, not checked)."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and not value >= 0:
            raise UserError(f"{name} must not be negative, got {value}")


def check_choice(cfg, **allowed):
    """A one-line error for the first of cfg's settings (name=its allowed values) whose value is not allowed."""
    for name, values in allowed.items():
        if getattr(cfg, name) not in values:
            raise UserError(f"{name} must be one of {', '.join(map(str, values))}, got {getattr(cfg, name)!r}")


def _type_name(tp):
    if typing.get_origin(tp) is typing.Union:
        return " | ".join("None" if a is type(None) else a.__name__ for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(key, raw, tp, from_cli):
    """Turn raw (a string from the command line, or a parsed literal from a file) into type tp."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:  # Optional[X]
        if raw is None or (from_cli and raw in ("None", "none", "null")):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _convert(key, raw, inner, from_cli)
    if from_cli:
        if tp is str:
            # accept both --start=hello and --start='hello'
            try:
                value = ast.literal_eval(raw)
                return value if isinstance(value, str) else raw
            except (ValueError, SyntaxError):
                return raw
        if tp is bool and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        try:
            raw = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raise UserError(f"--{key}: cannot read {raw!r} as {_type_name(tp)}") from None
    if tp is float and isinstance(raw, int) and not isinstance(raw, bool):
        raw = float(raw)
    if tp is bool and isinstance(raw, int) and raw in (0, 1) and not isinstance(raw, bool):
        raw = bool(raw)
    if typing.get_origin(tp) is tuple:
        if not isinstance(raw, (tuple, list)) or len(raw) != len(args):
            raise UserError(f"{key}: expected a tuple of {len(args)} values, got {raw!r}")
        return tuple(_convert(key, r, a, False) for r, a in zip(raw, args))
    if not isinstance(raw, tp) or (tp is int and isinstance(raw, bool)):
        raise UserError(f"{key}: expected {_type_name(tp)}, got {raw!r} ({type(raw).__name__})")
    return raw


def read_config_file(path):
    """Parse a config file of `key = literal` lines into a dict, executing nothing."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path} is not UTF-8 text (bad byte at offset {e.start})") from None
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: not a valid config line ({e.msg})") from None
    except ValueError as e:  # null bytes (Python < 3.12 raises ValueError for them)
        raise UserError(f"config file {path} is not a text file of key = value lines ({e})") from None
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise UserError(f"{path}:{node.lineno}: config files hold only `key = value` lines")
        key = node.targets[0].id
        try:
            values[key] = ast.literal_eval(node.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # e.g. {[1]: 2}: unhashable
            raise UserError(
                f"{path}:{node.lineno}: the value of {key} must be a plain literal "
                f"(number, string, True/False, None, tuple); config files are not executed"
            ) from None
    return values


def help_text(cls, usage):
    lines = [f"usage: {usage}", "", "settings (--key=value; config files hold key = value lines):"]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  --{f.name}={default!r}  ({_type_name(hints[f.name])})  {f.metadata.get('help', '')}")
    return "\n".join(lines)


def parse(cls, argv=None, usage="script.py [config_file ...] [--key=value ...]", extra_files_ok=True):
    """Build a cls instance from config files and --key=value arguments (default: sys.argv[1:])."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(cls, usage))
        sys.exit(0)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {}

    def set_value(key, raw, from_cli):
        if key not in fields:
            where = f"--{key}" if from_cli else key
            raise UserError(f"unknown setting {where}; see --help for the list")
        values[key] = _convert(key, raw, hints[key], from_cli)

    # config files first (in order), then the command line, wherever its arguments stand
    overrides = []
    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            if not eq and hints.get(key) is bool:
                raw = "True"  # a switch: --chat is --chat=True
            elif not eq:
                raise UserError(f"{arg}: write settings as --key=value")
            overrides.append((key, raw))
        elif extra_files_ok and not arg.startswith("-"):
            for key, raw in read_config_file(arg).items():
                set_value(key, raw, from_cli=False)
        else:
            raise UserError(f"unexpected argument {arg!r}; see --help")
    for key, raw in overrides:
        set_value(key, raw, from_cli=True)
    cfg = cls(**values)
    cfg._given = frozenset(values)  # (see given)
    return cfg


def given(cfg):
    """The names of the settings a config file or the command line set, as opposed to those left at their
    defaults (a resume compares only the model settings given with the checkpoint's). For settings built in
    code rather than parsed: those that differ from their defaults."""
    recorded = getattr(cfg, "_given", None)
    if recorded is not None:
        return recorded
    return {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}
