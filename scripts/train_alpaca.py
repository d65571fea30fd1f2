"""Stanford Alpaca's train.py, command-line compatible, on sft: `python scripts/train_alpaca.py --model_name_or_path ...`."""

from sft.cli.alpaca import main

if __name__ == "__main__":
    raise SystemExit(main())
