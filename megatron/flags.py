"""Flag declarations: each flag is declared once, on the config field it sets, and everything else derives from it.

A config field becomes a command-line flag by taking its default from flag() instead of a literal:

    lr_decay_style: str = flag("linear", "how the LR decays after warmup", choices=("constant", "linear", "cosine"))

From that one line come: the argparse option (spelling --lr-decay-style, type from the annotation, the choices,
the help with "(default: linear)" appended), the top-level DeepSpeed JSON key lr_decay_style that may set it,
the typed conversion of that JSON value, and the field default every other constructor of the config sees.

Adding a flag: add the field to its section in megatron/config.py with `= flag(default, "help", ...)`; if the field
belongs to a new section, list the class in config.FLAG_SECTIONS. Nothing in arguments.py changes. Options of
flag(): aliases (other spellings, "--batch-size"), choices, type/nargs/metavar (argparse's, for values the
annotation does not say: a tuple of ints, a float fraction in an int field), negation ("--no-embed-layernorm": a
second switch storing False), json (extra JSON keys, beyond each long spelling with underscores; False: none),
required (needed from the command line or the JSON; the field default then serves library callers only),
default_text (what an unset None means, shown in --help instead of "none"), deepspeed (the dotted key of
DeepSpeed's own JSON that holds the same setting, "zero_optimization.stage": it sets the flag when the flag is
not given, and stops the run naming both when they differ). Flags that set no config field
(the launcher's --local_rank, --deepspeed) are declared in arguments.py.

Pure: imports nothing from megatron and no third-party package (megatron.config imports it).
"""
import dataclasses
import json as _json
import typing

REQUIRED_TEXT = "required (here or in the DeepSpeed JSON)"


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One flag as declared on its field; dest, default, section and a type from the annotation are filled in by
    declared_flags()."""
    help: str
    aliases: tuple = ()
    choices: typing.Optional[tuple] = None
    type: typing.Optional[typing.Callable] = None
    nargs: object = None
    metavar: object = None
    negation: typing.Optional[str] = None
    json: object = ()
    required: bool = False
    default_text: typing.Optional[str] = None
    deepspeed: typing.Optional[str] = None
    spelling: typing.Optional[str] = None
    dest: str = ""
    default: object = None
    section: str = ""

    @property
    def spellings(self):
        return (self.spelling or "--" + self.dest.replace("_", "-"),) + tuple(self.aliases)

    @property
    def is_switch(self):
        return self.type is bool

    @property
    def shown_default(self):
        """The default as --help shows it."""
        if self.required:
            return REQUIRED_TEXT
        if self.default is None and self.default_text:
            return self.default_text
        return shown(self.default)

    def json_keys(self):
        """{top-level DeepSpeed JSON key: the value a true switch key stores (None for valued flags)}."""
        if self.json is False:
            return {}
        stored = True if self.is_switch else None
        keys = {s[2:].replace("-", "_"): stored for s in self.spellings if s.startswith("--")}
        keys.update({key: stored for key in self.json})
        if self.negation:
            keys[self.negation[2:].replace("-", "_")] = False
        return keys


def flag(default=dataclasses.MISSING, help="", **options):
    """A dataclass field that is also a flag (see the module docstring for the options)."""
    if not help:
        raise TypeError("flag() needs a help text")
    return dataclasses.field(default=default, metadata={"flag": FlagSpec(help=help, **options)})


def shown(value):
    """A value as --help and the messages print it: none, on/off, space-separated lists."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) if value else "none"
    return str(value)


def comma_separated(text):
    """argparse type: 'a, b,c' -> ('a', 'b', 'c')."""
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def _annotation_type(annotation):
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def declared_flags(sections):
    """Every FlagSpec of the given (title, dataclass) sections, in order, completed from its field."""
    specs, seen = [], {}
    for title, cls in sections:
        for field in dataclasses.fields(cls):
            spec = field.metadata.get("flag")
            if spec is None:
                continue
            assert field.name not in seen, f"flag {field.name} declared on {seen[field.name]} and {cls.__name__}"
            seen[field.name] = cls.__name__
            kind = spec.type or _annotation_type(field.type)
            default = None if spec.required or field.default is dataclasses.MISSING else field.default
            specs.append(dataclasses.replace(spec, dest=field.name, default=default, section=title, type=kind))
    return tuple(specs)


def json_table(specs):
    """{DeepSpeed JSON key: (FlagSpec, value a true switch stores)} for the flags a top-level key may set."""
    return {key: (spec, stored) for spec in specs for key, stored in spec.json_keys().items()}


def _a(kind):
    return {int: "an integer", float: "a number", str: "a string"}.get(kind, "a string")


def json_value(spec, stored, key, value):
    """The value spec's dest takes from JSON key `key` (typed and checked as on the command line); ValueError
    naming the key, the flag and what it expects."""
    flag = spec.spellings[0]

    def bad(expected):
        return ValueError(f"DeepSpeed config {key}={_json.dumps(value)} is not a valid {flag}: expected {expected}; "
                          "fix the value or drop the key")
    if spec.is_switch:
        if not isinstance(value, bool):
            raise bad("true or false")
        return stored if value else not stored
    if spec.nargs in ("*", "+") or isinstance(spec.nargs, int):
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
            raise bad("a list of strings" if spec.type is str else f"a list of {_a(spec.type)[2:]}s")
        if isinstance(spec.nargs, int) and len(values) != spec.nargs:
            raise bad(f"a list of {spec.nargs} values")
        return tuple(_convert(spec, v, bad) for v in values)
    return _convert(spec, value, bad)


def _convert(spec, value, bad):
    kind = spec.type
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise bad(_a(kind))
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise bad("an integer")
        value = int(value)
    try:
        converted = kind(value)
    except ValueError:
        raise bad(_a(kind)) from None
    if spec.choices is not None and converted not in spec.choices:
        raise bad("one of " + ", ".join(map(str, spec.choices)))
    return converted
