"""One proof's outcome: its line in `sft check --prove` and its object in `--json`."""

from dataclasses import asdict, dataclass


@dataclass
class Proof:
    """name; passed (None: does not apply to this recipe); figure: the measured number; evidence on failure."""

    name: str
    passed: bool | None
    figure: str
    evidence: str = ""

    def line(self) -> str:
        status = {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]
        text = f"{status} {self.name:<11} {self.figure}"
        return text + ("\n" + _indent(self.evidence) if self.passed is False and self.evidence else "")

    def as_dict(self) -> dict:
        return asdict(self)


def _indent(text: str) -> str:
    return "\n".join("     " + line for line in text.splitlines())
