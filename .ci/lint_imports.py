"""``lint-imports`` (import-linter) for this layout: the contracts in ``pyproject.toml``.

``hicache_jax.models`` and ``hicache_jax.storage`` live in the top-level folders ``models/``
and ``storage/`` (setuptools ``package-dir``). grimp, which builds import-linter's graph,
walks a root package's folder, so from ``hicache_jax/`` alone it would miss both and drop
every import of them without a word; and it refuses a root package inside another one.
So ``pyproject.toml`` names them as root packages too, and this takes every root's folders
from the import system (the install maps them). Plain ``lint-imports`` stops on those two
roots (``NotATopLevelModule``) rather than check a graph without them.

Usage, from the repository root: python .ci/lint_imports.py [lint-imports options]
"""

import importlib.util
import sys

from grimp.adaptors.packagefinder import ImportLibPackageFinder
from grimp.application.config import settings
from importlinter.cli import lint_imports_command


class InstalledFolders(ImportLibPackageFinder):
    """A root package's folders where the import system finds it, nested or not."""

    def determine_package_directories(self, package_name, file_system):
        spec = importlib.util.find_spec(package_name)
        if spec is None or not spec.submodule_search_locations:
            return super().determine_package_directories(package_name, file_system)
        return set(spec.submodule_search_locations)


if __name__ == "__main__":
    settings.configure(PACKAGE_FINDER=InstalledFolders())
    # The graph builds in a fraction of a second: no cache folder in the work tree.
    lint_imports_command(["--no-cache", *sys.argv[1:]], prog_name="lint-imports")
