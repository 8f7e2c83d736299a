"""A small reader of C declarations, for the output of `gcc -E -dD` over NVIDIA's headers.

Why the preprocessor's output and not the header files: the headers choose members with
`#if`, align them with macros (`NV_DECLARE_ALIGNED`) and size arrays with macro arithmetic;
after `gcc -E` all of that is resolved exactly as the driver's own build resolves it, and
what is left is plain C declarations. This module reads them into a type model:

* `Unit.records`: every struct/union body, by key (its typedef name, else `struct tag`, else
  `<Parent>__<member>` for an anonymous one nested in a member), with its members;
* `Unit.typedefs`, `Unit.enum_values`, `Unit.defines` (object-like macros, from `-dD`) and
  the header each came from (from the linemarkers).

It understands what declarations in these headers use: typedefs, struct/union/enum bodies
(nested, anonymous), pointers, function pointers, arrays (multi-dimensional, sized by
constant expressions), bitfields, `__attribute__` and qualifiers. Function bodies of static
inline helpers are skipped. It is a developer tool (scripts/abigen), not shipped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<id>[A-Za-z_]\w*)
  | (?P<num>(?:0[xX][0-9a-fA-F]+|\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+)[uUlLfF]*)
  | (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*')
  | (?P<op>\.\.\.|<<|>>|<=|>=|==|!=|&&|\|\||->|\+\+|--|[-+*/%&|^~!<>?:;,.(){}\[\]=#])
""", re.X)

BUILTIN_WORDS = {"void", "char", "short", "int", "long", "float", "double", "signed",
                 "unsigned", "_Bool", "__int128"}
QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "__restrict__", "static",
              "extern", "inline", "__inline", "__inline__", "register", "auto",
              "__extension__", "_Noreturn", "_Thread_local", "__const"}


@dataclass
class Tok:
    kind: str
    text: str
    file: str


@dataclass
class TypeSpec:
    """What a declaration's specifiers name: a builtin ("unsigned int"), a typedef name,
    or a record/enum (`record` is the key of its body in Unit.records)."""
    kind: str  # "builtin" | "typedef" | "struct" | "union" | "enum"
    name: str = ""  # builtin words, typedef name, or tag
    record: str | None = None  # key of the record body (struct/union), when known


@dataclass
class Declarator:
    name: str | None
    pointer: int = 0
    dims: list = field(default_factory=list)  # array dimension expressions (token lists)
    function: bool = False  # a function or a function pointer
    bits: list | None = None  # bitfield width expression


@dataclass
class Member:
    spec: TypeSpec
    decl: Declarator


@dataclass
class Record:
    key: str
    kind: str  # "struct" | "union"
    members: list[Member]
    file: str
    tag: str = ""


@dataclass
class Typedef:
    name: str
    spec: TypeSpec
    decl: Declarator
    file: str


class ParseError(Exception):
    pass


class Unit:
    """One preprocessed translation unit."""

    def __init__(self, text: str):
        self.defines: dict[str, tuple[str, str]] = {}  # name -> (body, file)
        self.fdefines: dict[str, tuple[list[str], str, str]] = {}  # name -> (args, body, file)
        self.records: dict[str, Record] = {}
        self.tags: dict[tuple[str, str], str] = {}  # (kind, tag) -> record key
        self.typedefs: dict[str, Typedef] = {}
        self.enum_values: dict[str, int] = {}
        self.renamed: dict[str, str] = {}  # a body's first key -> its typedef name
        self._anon = 0
        self.toks = self._tokenize(text)
        self.i = 0
        self._parse_unit()

    # ------------------------------------------------------------------ lexing
    def _tokenize(self, text: str) -> list[Tok]:
        out: list[Tok] = []
        cur = "<unknown>"
        for line in text.split("\n"):
            s = line.lstrip()
            if s.startswith("#"):
                m = re.match(r'#\s*(\d+)\s+"([^"]*)"', s)
                if m:
                    cur = m.group(2)
                    continue
                m = re.match(r"#\s*define\s+(\w+)(\(([^)]*)\))?\s*(.*)$", s)
                if m:
                    if m.group(2) is not None:
                        args = [a.strip() for a in m.group(3).split(",") if a.strip()]
                        self.fdefines[m.group(1)] = (args, m.group(4).strip(), cur)
                    else:
                        self.defines[m.group(1)] = (m.group(4).strip(), cur)
                    continue
                m = re.match(r"#\s*undef\s+(\w+)", s)
                if m:
                    self.defines.pop(m.group(1), None)
                    self.fdefines.pop(m.group(1), None)
                continue  # #pragma and the like
            pos = 0
            while pos < len(line):
                m = _TOKEN.match(line, pos)
                if not m:
                    raise ParseError(f"{cur}: cannot tokenize {line[pos:pos + 40]!r}")
                pos = m.end()
                k = m.lastgroup
                if k != "ws":
                    out.append(Tok(k, m.group(), cur))
        out.append(Tok("eof", "", cur))
        return out

    # ------------------------------------------------------------------ token helpers
    def peek(self, k: int = 0) -> Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def next(self) -> Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def expect(self, text: str) -> Tok:
        t = self.next()
        if t.text != text:
            raise ParseError(f"{t.file}: expected {text!r}, got {t.text!r} "
                             f"near {' '.join(x.text for x in self.toks[self.i - 8:self.i + 8])}")
        return t

    def _skip_balanced(self, open_: str, close: str) -> list[Tok]:
        """At an opening bracket: consume through its match; return the tokens inside."""
        self.expect(open_)
        depth, out = 1, []
        while True:
            t = self.next()
            if t.kind == "eof":
                raise ParseError(f"unbalanced {open_}")
            if t.text == open_:
                depth += 1
            elif t.text == close:
                depth -= 1
                if depth == 0:
                    return out
            out.append(t)

    def _skip_attributes(self) -> None:
        while True:
            t = self.peek()
            if t.text in ("__attribute__", "__attribute", "__declspec", "__asm__", "asm",
                          "__asm", "_Alignas", "__alignof__"):
                self.next()
                self._skip_balanced("(", ")")
            elif t.text in QUALIFIERS:
                self.next()
            else:
                return

    # ------------------------------------------------------------------ declarations
    def _parse_unit(self) -> None:
        while self.peek().kind != "eof":
            t = self.peek()
            if t.text == ";":
                self.next()
                continue
            if t.text in ("_Static_assert", "static_assert"):
                self.next()
                self._skip_balanced("(", ")")
                continue
            self._external_declaration()

    def _external_declaration(self) -> None:
        is_typedef = False
        self._skip_attributes()
        if self.peek().text == "typedef":
            self.next()
            is_typedef = True
        spec = self._type_spec()
        if self.peek().text == ";":
            self.next()
            return
        while True:
            d = self._declarator()
            self._skip_attributes()
            if self.peek().text == "=":  # initialised object: skip the initialiser
                self.next()
                depth = 0
                while not (depth == 0 and self.peek().text in (",", ";")):
                    t = self.next()
                    depth += t.text in "({[" and len(t.text) == 1
                    depth -= t.text in ")}]" and len(t.text) == 1
            if self.peek().text == "{":  # a function body
                self._skip_balanced("{", "}")
                return
            if is_typedef and d.name:
                self.typedefs.setdefault(d.name, Typedef(d.name, spec, d, self.peek().file))
                if spec.kind in ("struct", "union") and spec.record and not d.pointer \
                        and not d.dims and not d.function:
                    self._name_record(spec.record, d.name)
            t = self.next()
            if t.text == ";":
                return
            if t.text != ",":
                raise ParseError(f"{t.file}: unexpected {t.text!r} after declarator {d.name}")

    def _name_record(self, key: str, name: str) -> None:
        """The first typedef of an anonymous/tagged body gives it its table key."""
        rec = self.records.get(key)
        if rec is None or not key.startswith(("anon:", "struct ", "union ")):
            return
        if name in self.records:
            return
        del self.records[key]
        rec.key = name
        self.records[name] = rec
        self.renamed[key] = name
        for k, v in list(self.tags.items()):
            if v == key:
                self.tags[k] = name

    def _type_spec(self) -> TypeSpec:
        words: list[str] = []
        spec: TypeSpec | None = None
        while True:
            self._skip_attributes()
            t = self.peek()
            if t.text in ("struct", "union"):
                spec = self._record_spec()
            elif t.text == "enum":
                spec = self._enum_spec()
            elif t.text in BUILTIN_WORDS:
                words.append(self.next().text)
            elif t.text in ("__typeof__", "typeof", "__typeof"):
                self.next()
                self._skip_balanced("(", ")")
                spec = TypeSpec("builtin", "int")
            elif (t.kind == "id" and spec is None and not words and t.text in self.typedefs):
                self.next()
                spec = TypeSpec("typedef", t.text)
            elif (t.kind == "id" and spec is None and not words
                  and t.text in ("__builtin_va_list",)):
                self.next()
                spec = TypeSpec("builtin", "__builtin_va_list")
            else:
                break
        if spec is None:
            if not words:
                t = self.peek()
                raise ParseError(f"{t.file}: no type before {t.text!r} near "
                                 f"{' '.join(x.text for x in self.toks[self.i - 6:self.i + 6])}")
            spec = TypeSpec("builtin", " ".join(words))
        return spec

    def _record_spec(self) -> TypeSpec:
        kind = self.next().text
        self._skip_attributes()
        tag = ""
        if self.peek().kind == "id":
            tag = self.next().text
        self._skip_attributes()
        if self.peek().text != "{":
            key = self.tags.get((kind, tag))
            return TypeSpec(kind, tag, key)
        file = self.peek().file
        if tag:
            key = self.tags.get((kind, tag)) or f"{kind} {tag}"
        else:
            self._anon += 1
            key = f"anon:{self._anon}"
        members = self._record_body()
        rec = Record(key, kind, members, file, tag)
        self.records[key] = rec
        if tag:
            self.tags[(kind, tag)] = key
        self._skip_attributes()
        return TypeSpec(kind, tag, key)

    def _record_body(self) -> list[Member]:
        self.expect("{")
        members: list[Member] = []
        while self.peek().text != "}":
            if self.peek().text == ";":
                self.next()
                continue
            if self.peek().text in ("_Static_assert", "static_assert"):
                self.next()
                self._skip_balanced("(", ")")
                continue
            spec = self._type_spec()
            if self.peek().text == ";":  # anonymous struct/union member
                self.next()
                members.append(Member(spec, Declarator(None)))
                continue
            while True:
                if self.peek().text == ":":  # unnamed bitfield
                    d = Declarator(None)
                else:
                    d = self._declarator()
                if self.peek().text == ":":
                    self.next()
                    expr = []
                    while self.peek().text not in (",", ";"):
                        expr.append(self.next())
                    d.bits = expr
                self._skip_attributes()
                members.append(Member(spec, d))
                t = self.next()
                if t.text == ";":
                    break
                if t.text != ",":
                    raise ParseError(f"{t.file}: unexpected {t.text!r} in a record body")
        self.expect("}")
        return members

    def _enum_spec(self) -> TypeSpec:
        self.next()
        self._skip_attributes()
        tag = ""
        if self.peek().kind == "id":
            tag = self.next().text
        self._skip_attributes()
        if self.peek().text == ":":  # C23 fixed underlying type
            self.next()
            self._type_spec()
        if self.peek().text == "{":
            body = self._skip_balanced("{", "}")
            value = -1
            parts: list[list[Tok]] = [[]]
            depth = 0
            for t in body:
                if t.text in "([{" and len(t.text) == 1:
                    depth += 1
                elif t.text in ")]}" and len(t.text) == 1:
                    depth -= 1
                if t.text == "," and depth == 0:
                    parts.append([])
                else:
                    parts[-1].append(t)
            for p in parts:
                if not p:
                    continue
                name = p[0].text
                if len(p) > 2 and p[1].text == "=":
                    try:
                        value = self.eval_tokens(p[2:])
                    except Exception:
                        value = value + 1
                else:
                    value += 1
                self.enum_values[name] = value
        return TypeSpec("enum", tag)

    def _declarator(self) -> Declarator:
        d = Declarator(None)
        self._skip_attributes()
        while self.peek().text == "*":
            self.next()
            d.pointer += 1
            self._skip_attributes()
        if self.peek().text == "(" and self.peek(1).text in ("*", "^"):
            # function pointer (or pointer to array): ( * name ) ( params )
            self.next()
            inner = self._declarator()
            self.expect(")")
            d.name = inner.name
            d.pointer += max(inner.pointer, 1)
            d.dims = inner.dims
            if self.peek().text == "(":
                self._skip_balanced("(", ")")
                d.function = True
            while self.peek().text == "[":
                self._skip_balanced("[", "]")
            return d
        if self.peek().kind == "id" and self.peek().text not in QUALIFIERS:
            d.name = self.next().text
        self._skip_attributes()
        while True:
            t = self.peek()
            if t.text == "[":
                d.dims.append(self._skip_balanced("[", "]"))
            elif t.text == "(":
                self._skip_balanced("(", ")")
                d.function = True
            else:
                break
            self._skip_attributes()
        return d

    def record(self, key: str | None) -> Record | None:
        while key in self.renamed:
            key = self.renamed[key]
        return self.records.get(key) if key else None

    # ------------------------------------------------------------------ constants
    def eval_tokens(self, toks: list[Tok], sizeof=None) -> int:
        """Evaluate an integer constant expression (array sizes, enum values)."""
        return eval_c_expr(" ".join(t.text for t in toks), self._ident_value, sizeof)

    def _ident_value(self, name: str):
        if name in self.enum_values:
            return self.enum_values[name]
        if name in self.defines:
            return eval_c_expr(self.defines[name][0], self._ident_value)
        return None

    def define_value(self, name: str) -> int | None:
        try:
            v = self._ident_value(name)
        except Exception:
            return None
        return v


_CAST = re.compile(r"\(\s*(?:const\s+)?(?:unsigned\s+|signed\s+)?"
                   r"(?:NvU8|NvU16|NvU32|NvU64|NvS8|NvS16|NvS32|NvS64|NvUPtr|NvLength|"
                   r"int|long|long long|char|short|unsigned|size_t|uint32_t|uint64_t)"
                   r"(?:\s+long)*\s*\)")


def eval_c_expr(expr: str, ident, sizeof=None, depth: int = 0) -> int:
    """Integer constant expressions as C writes them in these headers: suffixes (U, L, ULL),
    integer casts, sizeof(TYPE) (through the `sizeof` callback), the ternary operator and
    macro/enum names (through `ident`)."""
    if depth > 40:
        raise ValueError(f"recursion evaluating {expr!r}")
    e = expr.strip()
    e = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", e)
    if sizeof is not None:
        e = re.sub(r"\bsizeof\s*\(\s*([\w ]+?)\s*\)", lambda m: str(sizeof(m.group(1))), e)
    e = _CAST.sub(" ", e)

    def rep(m):
        n = m.group(0)
        if n in ("and", "or", "not", "if", "else"):
            return n
        v = ident(n)
        if v is None:
            raise ValueError(f"undefined {n} in {expr!r}")
        return f"({v})"

    e = re.sub(r"\b[A-Za-z_]\w*\b", rep, e)
    e = e.replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"!(?!=)", " not ", e)
    # C's a ? b : c -> Python's (b if a else c), innermost first
    for _ in range(20):
        m = re.search(r"([^?:()]+)\?([^?:()]+):([^?:()]+)", e)
        if not m:
            break
        e = e[:m.start()] + f"(({m.group(2)}) if ({m.group(1)}) else ({m.group(3)}))" + e[m.end():]
    e = e.replace("/", "//")
    v = eval(e, {"__builtins__": {}}, {})  # noqa: S307 - digits and operators only
    return int(v)
