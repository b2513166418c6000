"""atom-sglang-plugin: ATOM's models inside SGLang, selected with `--model-impl atom`.

SGLang discovers `register` from this package's `sglang.srt.plugins` entry point and calls it in
every process it starts (through `sglang.srt.plugins.load_plugins`). It returns fast, imports
heavy modules only inside, and tolerates repeated calls. `ATOM_DISABLE_SGLANG_PLUGIN=1` turns it
off.
"""

__version__ = "0.1.0"


def register() -> None:
    """`sglang.srt.plugins` hook: give `--model-impl atom` its meaning (see `activation`)."""
    from atom_sglang_plugin.activation import install_model_selection

    install_model_selection()
