"""Rule-based verifiers: final answers of GSM8K (numbers compared by value), ``\\boxed{}`` math
answers (HF's math-verify), countdown expressions, and the built-in digit reversal."""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from typing import List, Optional, Sequence

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def to_number(text: str) -> Optional[Fraction]:
    """A number written as 1,234 / 3.50 / -2 / 3/4 / \\frac{3}{4} / $12 / 45% / 7 apples, or None."""
    s = text.strip().replace("$", "").replace("\\!", "").replace("\\,", "").replace(" ", "")
    m = re.fullmatch(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if m:
        try:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        except (ValueError, ZeroDivisionError):
            return None
    s = re.sub(r"\\text\{[^}]*\}|\\%|%|\\mathrm\{[^}]*\}", "", s)
    s = re.sub(r"[a-zA-Z]+\.?$", "", s)  # a trailing unit word
    if not s:
        return None
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(got: Optional[str], expected) -> bool:
    """Equal by value when both are numbers, else equal as normalised strings."""
    if got is None:
        return False
    a, b = to_number(got), to_number(str(expected))
    if a is not None and b is not None:
        return a == b
    norm = lambda s: re.sub(r"\s+|\\left|\\right|\$", "", str(s)).rstrip(".").lower()
    return norm(got) == norm(expected)


def boxed_answer(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None  # unbalanced


def gsm8k_answer(text: str) -> Optional[str]:
    """The answer after ``####``, else the last number in the text."""
    m = re.search(r"####\s*([^\n]+)", text)
    if m:
        numbers = _NUMBER.findall(m.group(1))
        return numbers[0] if numbers else m.group(1).strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def gsm8k_reward(response: str, answer) -> float:
    expected = gsm8k_answer(str(answer)) if "####" in str(answer) else str(answer)
    return float(same_answer(gsm8k_answer(response), expected))


MATH_TIMEOUT_S = 5  # seconds (whole: signal.alarm): math-verify's limit on parsing and on comparing one answer


def math_reward(response: str, answer) -> float:
    """1 when the response's final answer (its last ``\\boxed{}``, else its last LaTeX or plain
    expression) equals ``answer`` mathematically, by HF's math-verify: fractions, roots and pi
    symbolically, sets, intervals, equations (``x=5`` against ``5``), percentages, units in
    ``\\text{}`` and multiple-choice letters. Parsing and comparing each take at most
    MATH_TIMEOUT_S (math-verify's signal-based limit, in the reward worker's main thread)."""
    import threading

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig, parse, verify

    timeout = MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    text = str(answer).strip()
    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"  # a bare LaTeX answer (the datasets' convention)
    gold = parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig(), StringExtractionConfig()],
                 parsing_timeout=timeout)
    got = parse(response, parsing_timeout=timeout)
    if not gold or not got:
        return 0.0
    return float(verify(gold, got, timeout_seconds=timeout))


_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub)


def countdown_reward(response: str, answer) -> float:
    """``answer`` = {"target": t, "numbers": [...]}: 1 if the last line's expression uses each
    given number at most once, only + - * / and parentheses, and equals the target."""
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if not lines:
        return 0.0
    expr = lines[-1].split("=")[0].strip()
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return 0.0
    if not all(isinstance(node, _ALLOWED) for node in ast.walk(tree)):
        return 0.0
    used: List[int] = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    pool = list(answer["numbers"])
    for n in used:
        if n not in pool:
            return 0.0
        pool.remove(n)

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp):
            return -value(node.operand)
        a, b = value(node.left), value(node.right)
        return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}.get(type(node.op)) if not isinstance(node.op, ast.Div) else a / b

    try:
        return float(value(tree) == Fraction(answer["target"]))
    except ZeroDivisionError:
        return 0.0


def exact_match(response: str, answer) -> float:
    return float(response.strip() == str(answer).strip())


def as_scores(values: Sequence[float]) -> List[float]:
    return [float(v) for v in values]
