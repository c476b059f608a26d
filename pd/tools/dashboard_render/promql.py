"""The PromQL subset the pdkv Grafana dashboard is written in, evaluated over a list of scrapes.

Grafana is not always at hand (it is not on a CI machine), so
`pd.tools.dashboard_render` evaluates the dashboard's own queries here. The
dashboard keeps to this grammar (tests/deploy/test_dashboard.py parses every
query with it):

    expr        := term (('+' | '-') term)*
    term        := atom (('*' | '/') atom)*
    atom        := NUMBER | '(' expr ')' | call | aggregation | selector
    call        := ('rate' | 'irate' | 'increase') '(' selector '[' DURATION ']' ')'
                 | 'histogram_quantile' '(' NUMBER ',' expr ')'
    aggregation := AGG [by '(' labels ')'] '(' expr ')' [by '(' labels ')']    AGG: sum max min avg count
    selector    := NAME ['{' LABEL ('=' | '!=' | '=~' | '!~') STRING, ... '}']

Semantics follow Prometheus, with two simplifications, both stated: a range
is the scrapes in (t - range, t] and `rate` is their increase (counter resets
handled) over the time between the first and the last of them, without
Prometheus's extrapolation to the window's edges; `increase` is that rate times
the range. Regexes match whole label values, as in Prometheus. Arithmetic drops
the metric name; vector-vector operators match series on identical label sets.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import re
from collections.abc import Callable, Sequence
from itertools import pairwise

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs; `__name__` only on plain selectors
Vector = dict[Labels, float]
_AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum, "max": max, "min": min, "avg": lambda v: sum(v) / len(v), "count": len}
_RANGE_FUNCTIONS = ("rate", "irate", "increase")
_DURATION_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_TOKEN = re.compile(r"""\s*(?:
    (?P<duration>\[\s*\d+(?:ms|s|m|h|d)\s*\])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<op>=~|!~|!=|[-+*/(){},=])
)""", re.VERBOSE)


class QueryError(ValueError):
    """A query outside the subset, or malformed."""


@dataclasses.dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str

    def matches(self, value: str) -> bool:
        if self.op in ("=", "!="):
            return (value == self.value) == (self.op == "=")
        return (re.fullmatch(self.value, value) is not None) == (self.op == "=~")


@dataclasses.dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[Matcher, ...] = ()


@dataclasses.dataclass(frozen=True)
class Number:
    value: float


@dataclasses.dataclass(frozen=True)
class RangeCall:
    function: str  # rate irate increase
    selector: Selector
    range_s: float


@dataclasses.dataclass(frozen=True)
class Quantile:
    q: float
    expr: Node


@dataclasses.dataclass(frozen=True)
class Aggregation:
    op: str
    by: tuple[str, ...] | None  # None: aggregate everything into one series
    expr: Node


@dataclasses.dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node


Node = Number | Selector | RangeCall | Quantile | Aggregation | Binary


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One /metrics scrape: its time (seconds) and sample name -> {labels: value}."""

    t: float
    samples: dict[str, Vector]

    @classmethod
    def parse(cls, t: float, text: str) -> Scrape:
        samples: dict[str, Vector] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return cls(t, samples)


def expand(expr: str, variables: dict[str, str]) -> str:
    """Grafana's template variables (`$name`, `${name}`) replaced by their values; an unknown one is an error."""

    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise QueryError(f"unknown template variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def parse(text: str) -> Node:
    """The query's syntax tree; QueryError for anything outside the subset."""
    parser = _Parser(text)
    node = parser.expr()
    rest = parser.peek()
    if rest is not None:
        raise QueryError(f"unexpected {rest[1]!r} in {text!r}")
    return node


def selectors(node: Node) -> list[Selector]:
    """Every series selector in the query, in order."""
    if isinstance(node, Selector):
        return [node]
    if isinstance(node, RangeCall):
        return [node.selector]
    if isinstance(node, (Quantile, Aggregation)):
        return selectors(node.expr)
    if isinstance(node, Binary):
        return selectors(node.left) + selectors(node.right)
    return []


def evaluate(node: Node, scrapes: Sequence[Scrape], at: int) -> Vector | float:
    """The query's value at scrape `at` (index into `scrapes`, which are in time order)."""
    if isinstance(node, Number):
        return node.value
    if isinstance(node, Selector):
        return _select(node, scrapes[at])
    if isinstance(node, RangeCall):
        return _range_call(node, scrapes, at)
    if isinstance(node, Quantile):
        return _histogram_quantile(node.q, _vector(evaluate(node.expr, scrapes, at), "histogram_quantile"))
    if isinstance(node, Aggregation):
        return _aggregate(node, _vector(evaluate(node.expr, scrapes, at), node.op))
    return _binary(node.op, evaluate(node.left, scrapes, at), evaluate(node.right, scrapes, at))


def evaluate_range(node: Node, scrapes: Sequence[Scrape]) -> dict[Labels, list[float]]:
    """The query at every scrape: labels -> values (NaN where the series had no value)."""
    out: dict[Labels, list[float]] = {}
    for i in range(len(scrapes)):
        value = evaluate(node, scrapes, i)
        vector = {(): value} if isinstance(value, float) else value
        for labels, v in vector.items():
            out.setdefault(labels, [math.nan] * len(scrapes))[i] = v
    return out


# -- evaluation -------------------------------------------------------------
def _select(selector: Selector, scrape: Scrape) -> Vector:
    out = {}
    for labels, value in scrape.samples.get(selector.name, {}).items():
        as_dict = dict(labels)
        if all(m.matches(as_dict.get(m.label, "")) for m in selector.matchers):
            out[(("__name__", selector.name), *labels)] = value
    return out


def _range_call(node: RangeCall, scrapes: Sequence[Scrape], at: int) -> Vector:
    now = scrapes[at].t
    window = [s for s in scrapes[: at + 1] if s.t > now - node.range_s]
    points: dict[Labels, list[tuple[float, float]]] = {}
    for scrape in window:
        for labels, value in _select(node.selector, scrape).items():
            points.setdefault(_drop_name(labels), []).append((scrape.t, value))
    out = {}
    for labels, series in points.items():
        if len(series) < 2:
            continue
        if node.function == "irate":
            series = series[-2:]
        increase = sum(b - a if b >= a else b for (_, a), (_, b) in pairwise(series))  # a drop: a reset
        per_s = increase / (series[-1][0] - series[0][0])
        out[labels] = per_s * node.range_s if node.function == "increase" else per_s
    return out


def _histogram_quantile(q: float, vector: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, value in vector.items():
        le = dict(labels).get("le")
        if le is None:
            continue
        rest = tuple(kv for kv in _drop_name(labels) if kv[0] != "le")
        groups.setdefault(rest, []).append((float(le), value))
    return {labels: _quantile(q, sorted(buckets)) for labels, buckets in groups.items()}


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucket interpolation: linear within the bucket holding rank q * count."""
    if q < 0 or q > 1:
        return -math.inf if q < 0 else math.inf
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return math.nan
    counts: list[float] = []
    for _, count in buckets:  # cumulative counts never go down (a scrape between buckets could make them)
        counts.append(max(count, counts[-1]) if counts else count)
    total = counts[-1]
    if total <= 0:
        return math.nan
    rank = q * total
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    upper = buckets[b][0]
    if b == 0 and upper <= 0:
        return upper
    lower = 0.0 if b == 0 else buckets[b - 1][0]
    below = 0.0 if b == 0 else counts[b - 1]
    in_bucket = counts[b] - below
    return lower + (upper - lower) * ((rank - below) / in_bucket if in_bucket > 0 else 0.0)


def _aggregate(node: Aggregation, vector: Vector) -> Vector:
    groups: dict[Labels, list[float]] = {}
    for labels, value in vector.items():
        key = () if node.by is None else tuple(kv for kv in labels if kv[0] in node.by)
        groups.setdefault(key, []).append(value)
    combine = _AGGREGATIONS[node.op]
    return {key: float(combine(values)) for key, values in groups.items()}


def _binary(op: str, left: Vector | float, right: Vector | float) -> Vector | float:
    fn = _OPERATORS[op]
    if isinstance(left, float) and isinstance(right, float):
        return fn(left, right)
    if isinstance(right, float):
        return {_drop_name(k): fn(v, right) for k, v in _vector(left, op).items()}
    if isinstance(left, float):
        return {_drop_name(k): fn(left, v) for k, v in right.items()}
    rights = {_drop_name(k): v for k, v in right.items()}
    return {k: fn(v, rights[k]) for k, v in ((_drop_name(k), v) for k, v in left.items()) if k in rights}


def _divide(a: float, b: float) -> float:
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a)
    return a / b


_OPERATORS: dict[str, Callable[[float, float], float]] = {"+": operator.add, "-": operator.sub,
                                                          "*": operator.mul, "/": _divide}


def _vector(value: Vector | float, where: str) -> Vector:
    if isinstance(value, float):
        raise QueryError(f"{where} needs a vector, got the number {value}")
    return value


def _drop_name(labels: Labels) -> Labels:
    return tuple(kv for kv in labels if kv[0] != "__name__")


# -- parsing ----------------------------------------------------------------
class _Parser:
    def __init__(self, text: str) -> None:
        self.text, text = text, text.strip()  # inner whitespace: each token's pattern skips what precedes it
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None:
                raise QueryError(f"cannot read {text[pos:pos + 20]!r} in {text!r}")
            kind = str(match.lastgroup)
            self.tokens.append((kind, match.group(kind)))
            pos = match.end()
        self.pos = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, want: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (want is not None and token[1] != want):
            raise QueryError(f"expected {want or 'more'} in {self.text!r}, got {token[1] if token else 'the end'}")
        self.pos += 1
        return token

    def expr(self) -> Node:
        node = self.term()
        while (token := self.peek()) is not None and token[1] in ("+", "-"):
            self.take()
            node = Binary(token[1], node, self.term())
        return node

    def term(self) -> Node:
        node = self.atom()
        while (token := self.peek()) is not None and token[1] in ("*", "/"):
            self.take()
            node = Binary(token[1], node, self.atom())
        return node

    def atom(self) -> Node:
        kind, value = self.take()
        if kind == "number":
            return Number(float(value))
        if value == "(":
            node = self.expr()
            self.take(")")
            return node
        if kind != "name":
            raise QueryError(f"unexpected {value!r} in {self.text!r}")
        following = self.peek()
        if value in _AGGREGATIONS and following is not None and following[1] in ("(", "by"):
            return self.aggregation(value)
        if following is not None and following[1] == "(":
            return self.call(value)
        return self.selector(value)

    def aggregation(self, op: str) -> Aggregation:
        by = self.by_clause()
        self.take("(")
        inner = self.expr()
        self.take(")")
        if by is None:
            by = self.by_clause()
        return Aggregation(op, by, inner)

    def by_clause(self) -> tuple[str, ...] | None:
        token = self.peek()
        if token is None or token[1] != "by":
            return None
        self.take()
        self.take("(")
        labels = [self.take()[1]]
        while self.peek() is not None and self.peek() == ("op", ","):
            self.take(",")
            labels.append(self.take()[1])
        self.take(")")
        return tuple(labels)

    def call(self, function: str) -> Node:
        self.take("(")
        if function == "histogram_quantile":
            kind, q = self.take()
            if kind != "number":
                raise QueryError(f"histogram_quantile needs a number first in {self.text!r}")
            self.take(",")
            node: Node = Quantile(float(q), self.expr())
        elif function in _RANGE_FUNCTIONS:
            kind, name = self.take()
            selector = self.selector(name)
            kind, duration = self.take()
            if kind != "duration":
                raise QueryError(f"{function} needs a range like [1m] in {self.text!r}")
            amount, unit = re.fullmatch(r"\[\s*(\d+)(ms|s|m|h|d)\s*\]", duration).groups()  # type: ignore[union-attr]
            node = RangeCall(function, selector, int(amount) * _DURATION_S[unit])
        else:
            raise QueryError(f"function {function}() is outside the dashboard's PromQL subset ({self.text!r})")
        self.take(")")
        return node

    def selector(self, name: str) -> Selector:
        matchers = []
        if self.peek() == ("op", "{"):
            self.take("{")
            while self.peek() != ("op", "}"):
                label = self.take()[1]
                op = self.take()[1]
                kind, quoted = self.take()
                if op not in ("=", "!=", "=~", "!~") or kind != "string":
                    raise QueryError(f"bad matcher {label}{op}{quoted} in {self.text!r}")
                matchers.append(Matcher(label, op, re.sub(r"\\(.)", r"\1", quoted[1:-1])))
                if self.peek() == ("op", ","):
                    self.take(",")
            self.take("}")
        return Selector(name, tuple(matchers))
