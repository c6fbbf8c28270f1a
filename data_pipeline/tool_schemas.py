"""Schemas of the bundled tools (OpenAI function format): the bundled task demonstrations show
them (make_sample) and train.posttrain's environments answer them."""

CALCULATE = {"type": "function", "function": {
    "name": "calculate",
    "description": "The value of an arithmetic expression: numbers, + - * / // % ** and "
                   "parentheses.",
    "parameters": {"type": "object",
                   "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
