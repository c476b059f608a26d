"""Entry point: `python -m pd.launch` runs `pd.deploy.launch` (`--check-config`: `pd.deploy.config_check`,
which validates without importing Ray)."""
import sys

if __name__ == "__main__":
    if "--check-config" in sys.argv[1:] and not {"-h", "--help"} & set(sys.argv[1:]):
        from pd.deploy.config_check import main as check_config

        sys.exit(check_config(sys.argv[1:]))
    from pd.deploy.launch import main

    sys.exit(main())
