"""Faces of other libraries' APIs over infinity, for code written against them: ``deepspeed``
(``import infinity.compat.deepspeed as deepspeed``). The top layer, beside the adapters and the
command line: it uses the engine's public API and ``zero``'s, and nothing below imports it."""
