"""The OpenAI-compatible HTTP server (`api`), its engine thread (`async_engine`) and the DI router (`proxy`).

Imports go one way: server -> engine / tokenizer / sampling; nothing below imports the server.
"""
