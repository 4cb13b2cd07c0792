#!/usr/bin/env bash
# Debian's chromium for the status page's browser tests (tests/integration/test_dashboard_browser.py, driven by
# Playwright with executable_path=/usr/bin/chromium; Playwright's own browser download cannot be used here).
# Installs it with apt-get (update first) when /usr/bin/chromium is missing and we are root; otherwise says why
# and leaves the browser tests to skip. Exits 0 either way, unless apt-get itself fails.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "install_chromium.sh: /usr/bin/chromium is missing and we are not root; the browser tests will skip" >&2
  echo "  (as root: apt-get update && apt-get install -y chromium)" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_chromium.sh: /usr/bin/chromium is missing and there is no apt-get; the browser tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q chromium
