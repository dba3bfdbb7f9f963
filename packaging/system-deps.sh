#!/usr/bin/env bash
# Debian packages Cadence needs outside Python: speech synthesis and conversion for the tests
# (espeak-ng, sox), a C compiler (the int8 kernel, engine/native), PortAudio for recording, Xvfb for
# screenshots, and the libraries Qt's xcb and offscreen platforms load. Installs the missing ones when run as root; otherwise says what to install.
set -euo pipefail

declare -A lib_pkg=(
  [libportaudio.so.2]=libportaudio2
  [libGL.so.1]=libgl1
  [libEGL.so.1]=libegl1
  [libfontconfig.so.1]=libfontconfig1
  [libdbus-1.so.3]=libdbus-1-3
  [libglib-2.0.so.0]=libglib2.0-0
  [libxkbcommon.so.0]=libxkbcommon0
  [libxkbcommon-x11.so.0]=libxkbcommon-x11-0
  [libxcb-cursor.so.0]=libxcb-cursor0
  [libxcb-icccm.so.4]=libxcb-icccm4
  [libxcb-keysyms.so.1]=libxcb-keysyms1
  [libxcb-shape.so.0]=libxcb-shape0
  [libxcb-xinerama.so.0]=libxcb-xinerama0
  [libxcb-image.so.0]=libxcb-image0
  [libxcb-render-util.so.0]=libxcb-render-util0
  [libxcb-randr.so.0]=libxcb-randr0
  [libX11-xcb.so.1]=libx11-xcb1
)
declare -A cmd_pkg=([espeak-ng]=espeak-ng [sox]=sox [xvfb-run]=xvfb [xauth]=xauth [gcc]=gcc)

missing=()
for cmd in "${!cmd_pkg[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${cmd_pkg[$cmd]}")
done
libs=$(/sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null || true)
for lib in "${!lib_pkg[@]}"; do
  grep -q "$lib" <<<"$libs" || missing+=("${lib_pkg[$lib]}")
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "Cadence needs these system packages, which are missing: ${missing[*]}" >&2
  echo "Install them with: sudo apt-get install ${missing[*]}" >&2
  echo "(Continuing: the app runs without them, but tests that synthesise speech or take screenshots will fail.)" >&2
fi
