"""argparse with the hints a new user needs on a typo: `did you mean --memory-limit?` for a flag it does not
know, `did you mean simulate?` for a command or a choice it does not take (Python 3.14's suggest_on_error, for
the Pythons pipec supports, and for flags too)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from pipec.library import closest_name

_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)$")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors end with a suggestion when one is close to what was typed. `typed`
    (the whole command line, set by pipec.cli.main) is where it looks for unknown flags: an error about a missing
    --model is about `--modle`, typed beside it."""

    typed: Sequence[str] = ()
    command_parser: Parser | None = None  # the top level's: the parser of the command given (pipec.cli)

    def error(self, message: str):  # type: ignore[override]  # argparse's own signature; it exits
        super().error(message + self.suggestion(message))

    def suggestion(self, message: str) -> str:
        choice = _CHOICE.search(message)
        if choice:
            options = [c.strip().strip("'") for c in choice[2].split(",")]
            guess = closest_name(choice[1], options)
            return f" (did you mean {guess}?)" if guess else ""
        guesses = [f"{flag}: did you mean {guess}?" for flag, guess in self.unknown_flags()]
        return f" ({'; '.join(guesses)})" if guesses else ""

    def unknown_flags(self) -> list[tuple[str, str]]:
        """(typed flag, the closest flag this parser has) for each flag typed that it does not know (a prefix of
        one it knows is argparse's abbreviation, not a typo)."""
        known = [s for s in self._option_string_actions if s.startswith("--")]
        found = []
        for word in self.typed:
            flag = word.split("=", 1)[0]
            if not flag.startswith("--") or any(k.startswith(flag) for k in known):
                continue
            guess = closest_name(flag, known)
            if guess is not None:
                found.append((flag, guess))
        return found
