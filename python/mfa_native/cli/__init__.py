"""Commands of `python -m mfa_native`: one module each, with add_arguments(parser) and run(args)."""
