// The admin index dashboard (chorus_site/dashboard.py), live.  live.js follows the "dashboard"
// stream; any event from it only says "something changed": the page then re-reads the summary (at
// most one read at a time, one per second).  It also re-reads when the socket comes back (catching
// up on whatever was missed while it was down), every 10 s while it is down, and every refresh_s
// anyway (time alone makes a heartbeat stale).  Charts: Chart.js, shipped in static/chorus/vendor.
(function () {
  "use strict";
  var root = document.getElementById("chorus-dashboard");
  var dataNode = document.getElementById("chorus-dashboard-data");
  if (!root || !dataNode) return;
  var url = root.dataset.summaryUrl;
  var data = JSON.parse(dataNode.textContent);
  var COLOURS = {
    pending: "#9ca3af", running: "#3b82f6", requires_action: "#f97316", ended: "#22c55e", interrupted: "#ef4444",
    merged: "#a78bfa", planned: "#9ca3af", waiting: "#f59e0b", paused: "#fb923c", cancelling: "#94a3b8",
    succeeded: "#22c55e", partial_succeeded: "#eab308", failed: "#ef4444", cancelled: "#6b7280"
  };
  var charts = {};

  function label(state) { return state.replace(/_/g, " "); }

  function hourLabels(hours) {
    return hours.map(function (iso) {
      return new Date(iso).toLocaleTimeString(undefined, {hour: "numeric"});
    });
  }

  function datasets(chart) {
    return chart.series.map(function (s) {
      return {label: label(s.state), data: s.values, backgroundColor: COLOURS[s.state] || "#64748b", stack: "s"};
    });
  }

  function drawChart(name, chart) {
    var canvas = document.getElementById("chorus-chart-" + name);
    var empty = document.getElementById("chorus-chart-" + name + "-empty");
    if (empty && chart) empty.hidden = chart.series.length > 0;
    if (!canvas || !chart || typeof window.Chart === "undefined") return;
    var existing = charts[name];
    if (existing) {
      existing.data.labels = hourLabels(chart.hours);
      existing.data.datasets = datasets(chart);
      existing.update("none");
      return;
    }
    var style = getComputedStyle(document.body);
    window.Chart.defaults.color = style.getPropertyValue("--body-quiet-color").trim() || "#666";
    window.Chart.defaults.borderColor = style.getPropertyValue("--hairline-color").trim() || "#e5e7eb";
    charts[name] = new window.Chart(canvas, {
      type: "bar",
      data: {labels: hourLabels(chart.hours), datasets: datasets(chart)},
      options: {
        animation: false, responsive: true, maintainAspectRatio: false,
        scales: {x: {stacked: true, grid: {display: false}}, y: {stacked: true, beginAtZero: true, ticks: {precision: 0}}},
        plugins: {legend: {position: "bottom", labels: {boxWidth: 12}}}
      }
    });
  }

  function cell(row, content) {
    var td = document.createElement("td");
    if (content instanceof Node) td.appendChild(content); else td.textContent = content;
    row.appendChild(td);
    return td;
  }

  function link(href, text) {
    if (!href) return text;
    var a = document.createElement("a");
    a.href = href;
    a.textContent = text;
    return a;
  }

  function when(iso) {
    if (!iso) return "never";
    var node = document.createElement("time");
    node.className = "chorus-when";
    node.setAttribute("datetime", iso);
    node.textContent = window.chorusTimes ? window.chorusTimes.relative(new Date(iso), Date.now()) : iso;
    return node;
  }

  function fillTable(id, rows, build, emptyText, columns) {
    var table = document.getElementById(id);
    if (!table) return;
    var body = document.createElement("tbody");
    rows.forEach(function (item) { var tr = document.createElement("tr"); build(tr, item); body.appendChild(tr); });
    if (!rows.length) {
      var tr = document.createElement("tr");
      tr.className = "chorus-empty";
      cell(tr, emptyText).colSpan = columns;
      body.appendChild(tr);
    }
    table.replaceChild(body, table.tBodies[0]);
  }

  function render(summary) {
    (summary.attention || []).forEach(function (item) {
      var count = root.querySelector('[data-dash-count="' + item.key + '"]');
      if (!count) return;
      var text = item.count + (item.capped ? "+" : "");
      if (count.textContent !== text) {
        count.textContent = text;
        count.classList.add("chorus-flash");
        setTimeout(function () { count.classList.remove("chorus-flash"); }, 1500);
      }
      count.closest(".chorus-tile").classList.toggle("chorus-tile-hot", item.count > 0);
    });
    var updated = document.getElementById("chorus-dash-updated");
    if (updated) updated.textContent = "updated " + new Date(summary.at).toLocaleTimeString();
    Object.keys(summary.charts || {}).forEach(function (name) { drawChart(name, summary.charts[name]); });
    if (summary.connections) {
      var c = summary.connections.counts;
      var counts = document.getElementById("chorus-connection-counts");
      if (counts) counts.textContent = c.online + " online · " + c.draining + " draining · " + c.offline + " offline";
      fillTable("chorus-connections", summary.connections.rows, function (tr, r) {
        var name = cell(tr, link(r.url, r.name));
        if (r.host) {
          var host = document.createElement("span");
          host.className = "chorus-muted";
          host.textContent = " " + r.host;
          name.appendChild(host);
        }
        var badge = document.createElement("span");
        badge.className = "chorus-badge chorus-" + r.status;
        badge.textContent = r.status;
        cell(tr, badge);
        cell(tr, when(r.last_heartbeat_at));
      }, "No connections registered.", 3);
    }
    if (summary.audit) {
      fillTable("chorus-audit", summary.audit, function (tr, a) {
        cell(tr, when(a.at)); cell(tr, a.actor); cell(tr, a.action);
        cell(tr, link(a.target_url, a.target_label)).title = a.target;
        cell(tr, a.outcome);
      }, "No operator actions yet.", 5);
    }
    root.dataset.refreshed = String(Number(root.dataset.refreshed || 0) + 1);
  }

  var busy = false, again = false, timer = null, lastRead = 0;
  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    lastRead = Date.now();
    fetch(url, {credentials: "same-origin", headers: {Accept: "application/json"}})
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(render)
      .catch(function () { /* the next wake-up, reconnect or periodic read tries again */ })
      .then(function () { busy = false; if (again) { again = false; schedule(); } });
  }
  function schedule() {
    if (timer) return;
    var wait = Math.max(200, 1000 - (Date.now() - lastRead));
    timer = setTimeout(function () { timer = null; refresh(); }, wait);
  }

  document.addEventListener("chorus:event", schedule);

  // The live indicator's state tells whether the socket is up: catch up when it comes back, poll
  // while it is down.
  var indicator = document.getElementById("chorus-live-status");
  var downPoll = null;
  if (indicator) {
    new MutationObserver(function () {
      if (indicator.dataset.state === "live") {
        if (downPoll) { clearInterval(downPoll); downPoll = null; }
        schedule();
      } else if (indicator.dataset.state === "offline" && !downPoll) {
        downPoll = setInterval(refresh, 10000);
      }
    }).observe(indicator, {attributes: true, attributeFilter: ["data-state"]});
  }
  setInterval(refresh, (data.refresh_s || 30) * 1000);

  Object.keys(data.charts || {}).forEach(function (name) { drawChart(name, data.charts[name]); });
})();
