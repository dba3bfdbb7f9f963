#!/usr/bin/env bash
# Add Cadence to the desktop's application menu (for this user): the launcher and its icon.
# Usage: bash packaging/install-desktop.sh [BUNDLE_DIR]
#   without BUNDLE_DIR the launcher runs `cadence-gui` from PATH (pip / `make setup` install);
#   with it (e.g. dist/cadence from `make package`) it runs that bundle's cadence-gui.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
apps="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
icons="${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/scalable/apps"
mkdir -p "$apps" "$icons"
cp "$here/resources/cadence.svg" "$icons/cadence.svg"
exec_line="cadence-gui"
if [ $# -ge 1 ]; then
  exec_line="\"$(cd "$1" && pwd)/cadence-gui\""  # quoted: the folder may contain spaces
fi
sed "s|^Exec=.*|Exec=$exec_line %F|" "$here/packaging/cadence.desktop" > "$apps/cadence.desktop"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database "$apps" || true
echo "Installed $apps/cadence.desktop (runs: $exec_line) and its icon."
