"""``python -m openk3.train [train options]`` -- the entry point torchrun launches on every rank."""

import argparse
import sys

from openk3.train.cli import add_train_arguments, train_config_from_args, train_main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m openk3.train")
    add_train_arguments(p)
    args = p.parse_args(argv)
    return train_main(train_config_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
