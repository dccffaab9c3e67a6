"""One declaration per setting (docs/cluster.md, "Settings and flags"): a config dataclass's
field carries its command-line flag (``settings/flags.py``); settings that several roles share
are declared once in ``settings/shared.py``. Standard library only, so every role may use it."""
