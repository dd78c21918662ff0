"""A small reader of the bash in the host-script templates (*.sh.j2), enough to tell in what context each simple
command runs: as a plain command, or where bash ignores errexit for it and for everything it calls
(a `&&`/`||` list, a pipeline, `!`, the condition of `if`/`while`/`until`) or runs it in a subshell whose
variables are lost (a pipeline, `$(…)`). Bash's own grammar (bash(1), SHELL GRAMMAR, and the `-e`
paragraph of `set`): "The shell does not exit if the command that fails is part of the command list
immediately following a while or until keyword, part of the test in an if statement, part of any
command executed in a && or || list except the command following the final && or ||, any command in a
pipeline but the last, or if the command's return value is being inverted with !" — and a function
called in such a context has errexit off for its whole body.

Not a full parser: Jinja lines are dropped and `{{ … }}` read as a word; comments, quoted strings,
heredoc bodies, `[[ … ]]`, `(( … ))` and `${ … }` are read as words. It is strict where it matters
here (every command word and every list operator outside quotes), and the templates are small.
Used by tests/test_shell_writes.py and the shell mutation harness (scripts/mutation-shell)."""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass, field

OPS = ("&&", "||", ";;", "|", ";", "&", "(", ")")
KEYWORDS_BEFORE_COMMAND = {"then", "do", "else", "time"}


@dataclass
class Tok:
    text: str
    line: int
    op: bool = False  # an operator (or newline), not a word


@dataclass
class Command:
    """A simple command: its words, the line it starts on, and whether errexit is ignored for it
    (``masked``) or it runs in a subshell (``subshell``), and why."""

    words: list[str]
    line: int
    masked: str = ""
    subshell: str = ""


@dataclass
class Script:
    commands: list[Command] = field(default_factory=list)
    # function name -> the simple commands of its body
    functions: dict[str, list[Command]] = field(default_factory=dict)


def code_lines(text: str) -> list[int]:
    """Line numbers (1-based) of the template that are shell code: not Jinja statements, comments or
    heredoc bodies."""
    out = []
    heredoc: str | None = None
    for n, raw in enumerate(text.splitlines(), 1):
        if heredoc is not None:
            if re.sub(r"\{\{.*?\}\}", "", raw).strip() == heredoc:
                heredoc = None
            continue
        s = raw.strip()
        if not s or s.startswith("#") or s.startswith("{%"):
            continue
        out.append(n)
        m = re.search(r"(?<!<)<<-?(?!<)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1", raw)
        if m:
            heredoc = m.group(2)
    return out


def tokens(text: str) -> list[Tok]:
    """The template as tokens: words and operators, a newline as ";" (a separator)."""
    lines = text.splitlines()
    keep = set(code_lines(text))
    code = "\n".join(_jinja(line) if n in keep else "" for n, line in enumerate(lines, 1))
    starts = [0] + [m.end() for m in re.finditer("\n", code)]
    toks: list[Tok] = []
    _scan(code, 0, lambda off: bisect.bisect_right(starts, off), toks)
    return toks


def _jinja(line: str) -> str:
    return re.sub(r"\{%.*?%\}", "", re.sub(r"\{\{.*?\}\}", "J", line))


def _skip_dq(s: str, i: int) -> int:
    """i at the opening double quote; the index after the closing one (``$( … )`` inside is skipped whole)."""
    i += 1
    depth = 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if s.startswith("$(", i):
            depth += 1
            i += 2
            continue
        if c == ")" and depth:
            depth -= 1
        elif c == "'" and depth:
            j = s.find("'", i + 1)
            i = len(s) if j < 0 else j
        elif c == '"':
            if not depth:
                return i + 1
            j = i + 1
            while j < len(s) and s[j] != '"':
                j += 2 if s[j] == "\\" else 1
            i = j
        i += 1
    return i


def _skip_balanced(s: str, i: int, open_: str, close: str) -> int:
    """i at ``open_``; the index after the matching ``close``."""
    depth = 0
    while i < len(s):
        if s.startswith(open_, i):
            depth += 1
            i += len(open_)
            continue
        if s.startswith(close, i):
            depth -= 1
            i += len(close)
            if depth == 0:
                return i
            continue
        if s[i] == "'":
            j = s.find("'", i + 1)
            i = len(s) if j < 0 else j + 1
            continue
        if s[i] == '"':
            i = _skip_dq(s, i)
            continue
        i += 1
    return i


def _scan(s: str, base: int, line_of: Callable[[int], int], out: list[Tok]) -> None:
    """Tokens of ``s``, which starts at offset ``base`` of the code (for line numbers)."""
    i = 0
    word = ""

    def flush() -> None:
        nonlocal word
        if word:
            out.append(Tok(word, line_of(base + i)))
            word = ""

    while i < len(s):
        c = s[i]
        if s.startswith("\\\n", i):  # a line continued
            flush()
            i += 2
            continue
        if c == "\n":
            flush()
            out.append(Tok(";", line_of(base + i), op=True))
            i += 1
            continue
        if c in " \t":
            flush()
            i += 1
            continue
        if c == "#" and not word:
            j = s.find("\n", i)  # a comment, to the end of the line
            i = len(s) if j < 0 else j
            continue
        if c == "'":
            j = s.find("'", i + 1)
            j = len(s) - 1 if j < 0 else j
            word += "Q"
            i = j + 1
            continue
        if c == '"':
            j = _skip_dq(s, i)
            inner = s[i + 1:j - 1]
            word += "Q"
            # Command substitutions inside the quotes run commands too: read them as $( … ).
            for m in re.finditer(r"\$\(", inner):
                if not inner.startswith("$((", m.start()):
                    end = _skip_balanced(inner, m.start() + 1, "(", ")")
                    _subst(inner[m.start() + 2:end - 1], base + i + 1 + m.start() + 2, line_of, out)
            i = j
            continue
        if s.startswith("$((", i):
            i = _skip_balanced(s, i + 1, "((", "))")
            word += "A"
            continue
        if s.startswith("$(", i):
            end = _skip_balanced(s, i + 1, "(", ")")
            _subst(s[i + 2:end - 1], base + i + 2, line_of, out)
            word += "S"
            i = end
            continue
        if s.startswith("${", i):
            i = _skip_balanced(s, i + 1, "{", "}")
            word += "V"
            continue
        if not word and (s.startswith("[[", i) or s.startswith("((", i)):
            close = "]]" if s[i] == "[" else "))"
            i = _skip_balanced(s, i, s[i:i + 2], close)
            out.append(Tok("[[" if close == "]]" else "((", line_of(base + i)))
            continue
        if s.startswith("<<<", i) or s.startswith("<<", i) or c in "<>":
            # Redirections are words of the command (the target is read as the next word).
            m = re.match(r"\d*(<<<|<<-?|>>|>&|<&|&>|>\||<>|<|>)", s[i:])
            assert m
            flush()
            out.append(Tok(m.group(0), line_of(base + i)))
            i += m.end()
            continue
        if c.isdigit() and not word and re.match(r"\d+(>>|>&|<&|<|>)", s[i:]):
            m = re.match(r"\d+(>>|>&|<&|<|>)", s[i:])
            assert m
            out.append(Tok(m.group(0), line_of(base + i)))
            i += m.end()
            continue
        if c == "(" and word.endswith("="):  # an array assignment: one word
            i = _skip_balanced(s, i, "(", ")")
            word += "L"
            continue
        op = next((o for o in OPS if s.startswith(o, i)), None)
        if op:
            flush()
            out.append(Tok(op, line_of(base + i), op=True))
            i += len(op)
            continue
        word += c
        i += 1
    flush()


def _subst(inner: str, base: int, line_of: Callable[[int], int], out: list[Tok]) -> None:
    out.append(Tok("$(", line_of(base), op=True))
    _scan(inner, base, line_of, out)
    out.append(Tok("$)", line_of(base + len(inner)), op=True))


class _Parser:
    def __init__(self, toks: list[Tok]) -> None:
        self.t = toks
        self.i = 0
        self.script = Script()
        self.fn: list[str] = []  # the functions being read (innermost last)

    def peek(self) -> Tok | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def until(self, text: str) -> None:
        while not self.at(text):
            if self.peek() is None:
                raise ValueError(f"no {text!r} where one was expected")
            self.i += 1

    def at(self, *texts: str) -> bool:
        p = self.peek()
        return p is not None and p.text in texts

    def skip_seps(self) -> None:
        while self.at(";", "&") and self.peek().op:  # type: ignore[union-attr]
            self.i += 1

    def seq(self, ends: tuple[str, ...], masked: str, subshell: str) -> None:
        """Commands up to (not including) a word or operator in ``ends``."""
        while True:
            self.skip_seps()
            p = self.peek()
            if p is None or p.text in ends:
                return
            self.andor(ends, masked, subshell)

    def andor(self, ends: tuple[str, ...], masked: str, subshell: str) -> None:
        items: list[tuple[int, int, bool]] = []  # (first command index, end index, negated)
        ops: list[str] = []
        while True:
            neg = False
            while self.at("!"):
                neg = True
                self.i += 1
            first = len(self.script.commands)
            self.command(ends, masked, subshell)
            items.append((first, len(self.script.commands), neg))
            if self.at("&&", "||", "|") and self.peek().op:  # type: ignore[union-attr]
                ops.append(self.peek().text)  # type: ignore[union-attr]
                self.i += 1
                while self.at(";") and self.peek().op and self.peek().text == ";":  # type: ignore[union-attr]
                    self.i += 1  # a newline after the operator
                continue
            break
        # Any part of a pipeline (a subshell, even the last), any part of a && / || list but the command
        # after the final operator (bash keeps errexit for that one), anything negated.
        for k, (a, b, neg) in enumerate(items):
            around = [o for o in (ops[k - 1] if k else "", ops[k] if k < len(ops) else "") if o]
            why = ("negated with !" if neg else "in a pipeline" if "|" in around
                   else f"under {ops[k]}" if k < len(ops) else "")
            sub = "in a pipeline (a subshell)" if "|" in around else ""
            for c in self.script.commands[a:b]:
                if why and not c.masked:
                    c.masked = why
                if sub and not c.subshell:
                    c.subshell = sub

    def command(self, ends: tuple[str, ...], masked: str, subshell: str) -> None:
        p = self.peek()
        if p is None:
            return
        if p.text == "if":
            self.i += 1
            self.seq(("then",), "in the condition of if", subshell)
            while True:
                self.i += 1  # then
                self.seq(("elif", "else", "fi"), masked, subshell)
                if self.at("elif"):
                    self.i += 1
                    self.seq(("then",), "in the condition of elif", subshell)
                    continue
                if self.at("else"):
                    self.i += 1
                    self.seq(("fi",), masked, subshell)
                break
            self.i += 1  # fi
            self.redirections()
            return
        if p.text in ("while", "until"):
            self.i += 1
            self.seq(("do",), f"in the condition of {p.text}", subshell)
            self.i += 1
            self.seq(("done",), masked, subshell)
            self.i += 1
            self.redirections()
            return
        if p.text in ("for", "select"):
            self.until("do")
            self.i += 1
            self.seq(("done",), masked, subshell)
            self.i += 1
            self.redirections()
            return
        if p.text == "case":
            self.until("in")
            self.i += 1
            while True:
                self.skip_seps()
                if self.at("esac") or self.peek() is None:
                    break
                self.until(")")  # the pattern
                self.i += 1
                self.seq((";;", "esac"), masked, subshell)
                if self.at(";;"):
                    self.i += 1
            self.i += 1
            self.redirections()
            return
        if p.text == "{":
            self.i += 1
            self.seq(("}",), masked, subshell)
            self.i += 1
            self.redirections()
            return
        if p.text == "(" and p.op:
            self.i += 1
            self.seq((")",), masked, "in a ( … ) subshell")
            self.i += 1
            self.redirections()
            return
        if p.text == "$(":
            self.subst(masked, subshell)
            return
        # A function definition: NAME ( ) { … } or NAME() { … }
        if (not p.op and self.i + 2 < len(self.t) and self.t[self.i + 1].text == "(" and self.t[self.i + 2].text == ")"):
            name = p.text
            self.i += 3
            self.skip_seps()
            first = len(self.script.commands)
            self.fn.append(name)
            self.command(ends, "", "")
            self.fn.pop()
            self.script.functions[name] = self.script.commands[first:]
            del self.script.commands[first:]
            return
        words: list[str] = []
        line = p.line
        while True:
            q = self.peek()
            if q is None or (q.op and q.text not in ("$(",)) or (not words and q.text in ends):
                break
            if q.text == "$(":
                self.subst(masked, subshell)
                continue
            words.append(q.text)
            self.i += 1
        # Assignments and keywords before the command word.
        while words and (re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=.*", words[0])
                         or words[0] in KEYWORDS_BEFORE_COMMAND):
            words.pop(0)
        if words:
            self.script.commands.append(Command(words, line, masked, subshell))

    def subst(self, masked: str, subshell: str) -> None:
        """$( … ): a subshell; bash clears errexit in it (no inherit_errexit)."""
        self.i += 1
        self.seq(("$)",), "in $( … ) (bash turns errexit off there)", "in $( … ) (a subshell)")
        self.i += 1

    def redirections(self) -> None:
        while self.peek() is not None and not self.peek().op and re.match(r"\d*[<>]", self.peek().text):  # type: ignore[union-attr]
            self.i += 2


def parse(text: str) -> Script:
    p = _Parser(tokens(text))
    p.seq((), "", "")
    return p.script


PUT = ("put", "put_cmd")


def put_callers(script: Script, names: tuple[str, ...] = PUT) -> set[str]:
    """The functions that call any of ``names``, directly or through each other."""
    found = set(names)
    while True:
        more = {f for f, body in script.functions.items() if f not in found and any(c.words[0] in found for c in body)}
        if not more:
            return found - set(names)
        found |= more


def masked_writes(text: str) -> list[tuple[int, str]]:
    """(line, what) for each call of put/put_cmd (or of a function that calls one) where a failure
    could be masked or ``changed`` lost: under &&/||, in a pipeline, negated, in a condition, in $( … )."""
    script = parse(text)
    callers = put_callers(script)
    out = []
    every = script.commands + [c for body in script.functions.values() for c in body]
    for c in every:
        name = c.words[0]
        if name not in PUT and name not in callers:
            continue
        via = "" if name in PUT else f" (it calls put)"
        why = c.masked or c.subshell
        if why:
            out.append((c.line, f"{name}{via} {why}"))
    return sorted(out)
