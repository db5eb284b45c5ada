// The outboxer dashboard's script (src/outboxer/dashboard.py serves it): the token field,
// the requeue and purge buttons and the chart. No build step, no dependency.
"use strict";

const TOKEN_KEY = "outboxer-token";
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2f6fdf", "#d9822b", "#1b9e77", "#a23b72", "#6b4fbb", "#5a6473"];

function setUpToken() {
  const input = document.getElementById("token");
  if (!input) return;
  // sessionStorage: this tab only, gone when it closes; never a URL or a cookie.
  input.value = sessionStorage.getItem(TOKEN_KEY) || "";
  input.addEventListener("input", () => sessionStorage.setItem(TOKEN_KEY, input.value));
}

function showResult(text, ok) {
  const result = document.getElementById("requeue-result");
  result.textContent = text;  // text, never HTML: an error message is data
  result.className = ok ? "ok" : "error";
}

// One message, by id, destination and status: the filter never matches more than its row.
async function change(button, path) {
  const headers = { "Content-Type": "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers["Authorization"] = "Bearer " + token;
  const body = {
    ids: [button.dataset.id],
    destinations: [button.dataset.destination],
    statuses: [button.dataset.status],
  };
  // A relay of several databases names the message's database.
  if (button.dataset.database) body.database = button.dataset.database;
  const row = button.closest("tr");
  const buttons = row.querySelectorAll("button");
  for (const each of buttons) each.disabled = true;
  try {
    const response = await fetch(path, {
      method: "POST", headers, body: JSON.stringify(body), credentials: "omit", cache: "no-store",
    });
    const answer = await response.json();
    if (!response.ok) {
      showResult(answer.error || "failed (" + response.status + ")", false);
      for (const each of buttons) each.disabled = false;
      return null;
    }
    return answer;
  } catch (error) {
    showResult("failed: " + error, false);
    for (const each of buttons) each.disabled = false;
    return null;
  }
}

// The filter matched no row: another operator (or another tab) purged or requeued the
// message since the page was made. The row keeps the status the page read, and says so.
function changedMeanwhile(button, done) {
  showResult(
    done + " nothing: message " + button.dataset.id + " is no longer " + button.dataset.status +
      " (changed since the page was loaded; reload it)",
    false,
  );
  for (const each of button.closest("tr").querySelectorAll("button")) each.disabled = false;
}

async function requeue(button) {
  const answer = await change(button, "/messages/requeue");
  if (answer === null) return;
  if (answer.deferred > 0) {
    // Left ABANDONED on purpose: sent now, it would be in flight beside a later message of
    // its key (docs/design/ordering.md). The row is as the page shows it; try again soon.
    showResult(
      "not requeued yet: a later message of its key is in flight; requeue " +
        button.dataset.id + " again once it is settled",
      false,
    );
    for (const each of button.closest("tr").querySelectorAll("button")) each.disabled = false;
    return;
  }
  if (!(answer.requeued > 0)) return changedMeanwhile(button, "requeued");
  showResult("requeued " + answer.requeued + " message(s): " + button.dataset.id, true);
  const row = button.closest("tr");
  row.querySelector("td.status").textContent = "PENDING";
}

async function purge(button) {
  // Deleted for good: the operator says so first.
  if (!window.confirm("Purge message " + button.dataset.id + "? It is deleted for good.")) return;
  const answer = await change(button, "/messages/purge");
  if (answer === null) return;
  if (!(answer.purged > 0)) return changedMeanwhile(button, "purged");
  showResult("purged " + answer.purged + " message(s): " + button.dataset.id, true);
  const row = button.closest("tr");
  row.querySelector("td.status").textContent = "PURGED";
  row.classList.add("purged");
}

function element(name, attributes, text) {
  const node = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawChart(series) {
  const svg = document.getElementById("chart");
  const legend = document.getElementById("chart-legend");
  if (!svg) return;
  svg.replaceChildren();
  legend.replaceChildren();
  const width = 640, height = 200, left = 40, right = 40, top = 10, bottom = 20;
  const points = series.points;
  const names = [...new Set(points.flatMap((point) => Object.keys(point.destinations)))].sort();
  svg.append(element("line", { class: "axis", x1: left, y1: height - bottom, x2: width - right, y2: height - bottom }));
  svg.append(element("line", { class: "axis", x1: left, y1: top, x2: left, y2: height - bottom }));
  if (points.length === 0) {
    svg.append(element("text", { x: width / 2, y: height / 2, "text-anchor": "middle" }, "collecting samples…"));
    return;
  }
  const first = points[0].at, last = points[points.length - 1].at;
  const span = Math.max(last - first, series.interval_seconds);
  const values = (name, field) => points.map((point) => (point.destinations[name] || {})[field]);
  const maxRate = Math.max(0.001, ...names.flatMap((name) => values(name, "rate").filter((v) => v != null)));
  const maxLatency = Math.max(0.001, ...names.flatMap((name) => values(name, "latency").filter((v) => v != null)));
  const x = (at) => left + ((at - first) / span) * (width - left - right);
  const y = (value, max) => height - bottom - (value / max) * (height - top - bottom);
  svg.append(element("text", { x: left - 4, y: top + 8, "text-anchor": "end" }, maxRate.toPrecision(2) + "/s"));
  const anyLatency = names.some((name) => values(name, "latency").some((v) => v != null));
  if (anyLatency) {
    svg.append(element("text", { x: width - right + 4, y: top + 8 }, maxLatency.toPrecision(2) + " s"));
  }
  svg.append(element("text", { x: left, y: height - 4 }, Math.round((last - first) / 60) + " min ago"));
  svg.append(element("text", { x: width - right, y: height - 4, "text-anchor": "end" }, "now"));
  names.forEach((name, index) => {
    const color = COLORS[index % COLORS.length];
    const rate = points.map((point) => [x(point.at), y((point.destinations[name] || {}).rate || 0, maxRate)]);
    svg.append(element("polyline", {
      class: "rate", "data-destination": name, fill: "none", stroke: color, "stroke-width": 2,
      points: rate.map(([px, py]) => px.toFixed(1) + "," + py.toFixed(1)).join(" "),
    }));
    const latency = points
      .filter((point) => (point.destinations[name] || {}).latency != null)
      .map((point) => [x(point.at), y(point.destinations[name].latency, maxLatency)]);
    if (latency.length > 0) {
      svg.append(element("polyline", {
        class: "latency", "data-destination": name, fill: "none", stroke: color, "stroke-width": 1.5,
        points: latency.map(([px, py]) => px.toFixed(1) + "," + py.toFixed(1)).join(" "),
      }));
    }
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.style.background = color;
    item.append(swatch, document.createTextNode(name));
    legend.append(item);
  });
}

async function refreshChart() {
  try {
    const response = await fetch("/dashboard/series", { credentials: "omit", cache: "no-store" });
    if (response.ok) drawChart(await response.json());
  } catch (error) {
    // The API is restarting or gone: the next refresh tries again.
  }
}

document.addEventListener("DOMContentLoaded", () => {
  setUpToken();
  for (const button of document.querySelectorAll("button.requeue")) {
    button.addEventListener("click", () => requeue(button));
  }
  for (const button of document.querySelectorAll("button.purge")) {
    button.addEventListener("click", () => purge(button));
  }
  refreshChart();
  setInterval(refreshChart, 5000);
});
