"""Verifiable 0/1 rewards for math word problems with a numeric final answer (GSM8K and alike).

Plain Python, no torch. None of these functions raises, on any string: a reward function that
throws ends a training run hours in. Every pattern is linear-time (no nested quantifiers), so a
100,000-character completion costs milliseconds, not a catastrophic regex backtrack.
"""

import re
from decimal import Decimal
from fractions import Fraction

# A number as people write it: optional minus, digits with optional thousands commas, optional decimals.
NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")
DECIMAL = r"-?[0-9]+(?:\.[0-9]+)?"
NUMBER_WITH_UNIT = re.compile(rf"({DECIMAL})[A-Za-z ]*")  # '18', '18 apples', '18 dollars'
SHORT = r"-?[0-9]{1,30}(?:\.[0-9]{1,30})?"  # a fraction's parts: exact arithmetic on them stays cheap
LATEX_FRACTION = re.compile(rf"(-?)\\[dt]?frac\{{({SHORT})\}}\{{({SHORT})\}}")  # '\frac{1}{2}', '-\dfrac{3}{4}'
SLASH_FRACTION = re.compile(rf"({SHORT})/({SHORT})")  # '1/2'
LATEX_TEXT = re.compile(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}")  # '\text{ dollars}' -> ' dollars'
BOXED_OR_BRACE = re.compile(r"\\boxed\{|[{}]")


def extract_gold(answer_field: str) -> str:
    """GSM8K gold answers end with '#### N': return N as written after the *last* '####'."""
    _, _, final = answer_field.rpartition("####")
    return final.strip()


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} whose braces close, matched in one pass with a stack."""
    stack, last_start, content = [], -1, None
    for match in BOXED_OR_BRACE.finditer(text):
        if match.group() == "}":
            if stack:
                opened_at, is_boxed = stack.pop()
                if is_boxed and opened_at > last_start:
                    last_start, content = opened_at, text[opened_at : match.start()]
        else:
            stack.append((match.end(), match.group() != "{"))
    return content


def extract_answer(completion: str) -> str | None:
    """The model's final answer: the last \\boxed{}, else the last <answer>…</answer>,
    else the first number after the last '####', else the last number in the text; None if none."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    close = completion.rfind("</answer>")
    open_ = completion.rfind("<answer>", 0, close) if close >= 0 else -1
    if open_ >= 0:
        return completion[open_ + len("<answer>") : close].strip()
    hashes = completion.rfind("####")
    if hashes >= 0:
        number = NUMBER.search(completion, hashes)
        if number:
            return number.group()
    numbers = NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def to_number(text: str) -> Decimal | Fraction | None:
    """The exact value of an answer that is one number, optionally with a unit: '$1,234.50' -> 1234.5, '18.' -> 18,
    '18 \\text{ dollars}' -> 18, '50\\%' -> 50; or one fraction: '\\frac{1}{2}', '\\dfrac{1}{2}', '1/2' -> 1/2.
    Anything else (an expression, several numbers) -> None: it earns credit only by an exact match."""
    cleaned = LATEX_TEXT.sub(r"\1", text)
    for sign in (",", "\\$", "$", "\\%", "%"):
        cleaned = cleaned.replace(sign, "")
    cleaned = cleaned.strip().rstrip(".").strip()
    if match := NUMBER_WITH_UNIT.fullmatch(cleaned):
        return Decimal(match.group(1))
    if match := LATEX_FRACTION.fullmatch(cleaned):
        sign, numerator, denominator = match.groups()
    elif match := SLASH_FRACTION.fullmatch(cleaned):
        sign, (numerator, denominator) = "", match.groups()
    else:
        return None
    if Decimal(denominator) == 0:
        return None
    value = Fraction(Decimal(numerator)) / Fraction(Decimal(denominator))  # exact: Decimal == Fraction compares exactly
    return -value if sign else value


def reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals the gold number exactly (18.00 == 18, 1,234 == 1234, \\frac{1}{2}
    == 0.5), else 0.0: '118' does not earn credit for 18, nor '\\frac{1}{2}' or '2x+1' for 2 or 1."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    predicted, expected = to_number(answer), to_number(gold)
    if predicted is None or expected is None:
        return float(answer == gold.strip() and answer != "")
    return float(predicted == expected)
