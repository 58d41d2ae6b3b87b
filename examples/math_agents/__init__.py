"""Example agents for `laden rl` (AReaL's agent contract, docs/agents.md), on `PYTHONPATH=examples`:

- `math_agents.calculator:CalculatorAgent`: multi-turn math with a calculator tool (OpenAI tool calling); a wrong
  answer gets feedback and another try, up to `max_turns` model calls; reward 1 for a correct final answer.
- `math_agents.tir:TIRAgent`: tool-integrated reasoning; Python the model writes in a fenced block runs in
  laden's sandbox (`laden.tools.sandbox`) and its output comes back as a tool turn; reward 1 for a correct answer.

Rows are `{"prompt": ..., "answer": ...}` (as `examples/prepare_arith.py` writes them), or carry `messages`
(AReaL's form) or `question` instead of `prompt`.

`python -m math_agents.tiny_run tir|calculator OUT` trains either agent on the tiny model on the CPU (a short
`laden sft` on the tool format, then GRPO with the agent) and prints its held-out accuracy before and after.
"""
