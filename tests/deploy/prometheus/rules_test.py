#!/usr/bin/python3
"""promtool on deploy/prometheus: the scrape config and rules check, the unit tests in
trn-alerts.test.yml pass, and every alert of trn-alerts.yml has a case there in which it fires.

  rules_test.py SOURCE_DIR
"""
import os
import subprocess
import sys

import yaml


def main(src):
    here = os.path.dirname(os.path.abspath(__file__))
    rules = os.path.join(src, "deploy/prometheus/trn-alerts.yml")
    tests = os.path.join(here, "trn-alerts.test.yml")
    for argv in (["promtool", "check", "config", os.path.join(src, "deploy/prometheus/prometheus.yml")],
                 ["promtool", "check", "rules", rules],
                 ["promtool", "test", "rules", tests]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            print(f"rules_test: FAIL: {' '.join(argv[:3])}:\n{r.stdout}{r.stderr}", file=sys.stderr)
            return 1
    with open(rules) as f:
        alerts = [r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r]
    with open(tests) as f:
        cases = [c for t in yaml.safe_load(f)["tests"] for c in t.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    untested = [a for a in alerts if a not in fired]
    if untested:
        print(f"rules_test: FAIL: no promtool case in which these fire: {', '.join(untested)}", file=sys.stderr)
        return 1
    print(f"rules_test: ok: {len(alerts)} alerts, each fires in a promtool case "
          f"({len(quiet & set(alerts))} also checked quiet), scrape config valid")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: rules_test.py SOURCE_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
